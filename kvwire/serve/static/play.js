// Chat and raw completion, one stream or several strengths side by side (compare mode: concurrent
// requests, so the engine runs them in one batch); stop, regenerate, the request as code.
import { $, parseList, parseNumber, show, stream, ServerGone } from "./api.js";
import { forgotten, refresh, strengths } from "./app.js";
import { saeFields } from "./sae.js";
import { snippets } from "./snippet.js";

let history = [];   // chat turns so far [{role, content}]
let last = null;    // the last run: {mode, compare, prompt, history} for Regenerate
let controllers = [];

function mode() { return $("mode-raw").checked ? "raw" : "chat"; }

const SAMPLING = ["temperature", "top-p", "max-tokens", "seed"];

// The number in box `id` (parseNumber's options); the box is marked while it holds a bad value.
function field(id, what, options) {
  const box = $(id);
  try {
    const value = parseNumber(box.value, what, options);
    box.classList.remove("invalid");
    return value;
  } catch (e) {
    box.classList.add("invalid");
    throw e;
  }
}

// The sampling fields of a request, checked as the server checks them (throws an Error naming the box).
function sampling() {
  const body = {
    temperature: field("temperature", "temperature", { min: 0 }),
    max_tokens: field("max-tokens", "max tokens", { integer: true, min: 1 }),
  };
  const topP = field("top-p", "top_p", { above: 0, max: 1 });
  if (topP < 1) body.top_p = topP;
  if ($("seed").value.trim()) body.seed = field("seed", "seed", { integer: true });
  const stops = $("stop-strings").value.split(",").map((s) => s.trim()).filter((s) => s);
  if (stops.length) body.stop = stops;
  return body;
}

// The requests of a run: [{label, strength, path, body}], one per column. Compare mode hides the
// chat, so its requests carry the prompt alone, not the chat's history.
function requests(run, state) {
  const base = { model: state.info.model, ...sampling(), ...saeFields() };
  const steer = strengths();
  const messages = [...(run.compare ? [] : run.history), { role: "user", content: run.prompt }];
  const content = (steerAt) => (run.mode === "chat"
    ? { path: "/v1/chat/completions", body: { ...base, messages, steer: steerAt } }
    : { path: "/v1/completions", body: { ...base, prompt: run.prompt, steer: steerAt } });
  if (!run.compare) return [{ label: "", ...content(steer) }];
  const name = $("compare-vector").value;
  if (!name) throw new Error("compare mode needs a control vector: load or train one first");
  const values = parseList($("compare-strengths").value, "the compare strengths");
  if (values.length > 8) throw new Error(`compare at most 8 strengths at once, got ${values.length}`);
  return values.map((s) => ({ label: `${name} = ${s}`, strength: s, ...content({ ...steer, [name]: s }) }));
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("regenerate").disabled = on || !last;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat-log").append(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

// Where each request's text goes: a chat bubble, the raw box, or a compare column.
function targets(run, reqs) {
  const single = !run.compare;
  $("compare-output").hidden = single;
  $("raw-output").hidden = !single || run.mode !== "raw";
  $("chat-log").hidden = !(single && run.mode === "chat");
  if (single && run.mode === "chat") {
    bubble("user", run.prompt);
    return [{ text: bubble("assistant", ""), status: null }];
  }
  if (single) {
    const out = $("raw-output");
    out.innerHTML = "";
    const echo = document.createElement("span");
    echo.className = "prompt-echo";
    echo.textContent = run.prompt;
    const text = document.createElement("span");
    text.className = "completion";
    out.append(echo, text);
    return [{ text, status: null }];
  }
  const columns = reqs.map((r) => {
    const col = document.createElement("div");
    col.className = "column";
    col.dataset.strength = String(r.strength);
    col.innerHTML = `<h3><span class="label"></span><span class="status">waiting…</span></h3><pre class="text"></pre>`;
    col.querySelector(".label").textContent = r.label;
    return col;
  });
  $("compare-output").replaceChildren(...columns);
  return columns.map((col) => ({ text: col.querySelector(".text"), status: col.querySelector(".status"), col }));
}

async function runOne(req, target, signal) {
  const piece = (obj) => {
    const c = obj.choices && obj.choices[0];
    if (!c) return;
    const text = c.delta ? c.delta.content : c.text;
    if (text) target.text.textContent += text;
    if (c.finish_reason && target.status) target.status.textContent = `done (${c.finish_reason})`;
    else if (target.status) target.status.textContent = "streaming…";
  };
  try {
    const how = await stream(req.path, req.body, signal, piece);
    if (how === "stopped" && target.status) target.status.textContent = "stopped";
    return { ok: true, text: target.text.textContent, stopped: how === "stopped" };
  } catch (e) {
    if (signal.aborted) {
      if (target.status) target.status.textContent = "stopped";
      return { ok: true, text: target.text.textContent, stopped: true };
    }
    if (target.status) target.status.textContent = e instanceof ServerGone ? "connection lost" : "failed";
    if (target.col) target.col.classList.add("lost");
    return { ok: false, error: e };
  }
}

// The run's requests, or null after showing what is wrong with the settings.
function prepare(run, state) {
  try {
    return requests(run, state);
  } catch (e) {
    show(e.message, "error");
    return null;
  }
}

async function execute(run, reqs, state) {
  show("");
  last = run;
  snippets(reqs, state);
  const outs = targets(run, reqs);
  controllers = reqs.map(() => new AbortController());
  busy(true);
  $("play-status").textContent = reqs.length > 1 ? `${reqs.length} requests streaming in one batch…` : "streaming…";
  const started = performance.now();
  const results = await Promise.all(reqs.map((r, i) => runOne(r, outs[i], controllers[i].signal)));
  controllers = [];
  const failed = results.find((r) => !r.ok);
  if (failed && failed.error.param === "steer" && await forget(run)) return;
  busy(false);
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  const stopped = results.some((r) => r.stopped);
  $("play-status").textContent = failed ? "" : stopped ? `stopped after ${seconds} s` : `done in ${seconds} s`;
  if (failed) {
    show(failed.error.message + (failed.error instanceof ServerGone ? ". Waiting for it to come back…" : ""), "error");
    if (run.mode === "chat" && !run.compare) $("chat-log").lastChild.classList.add("failed");
    return;
  }
  if (run.mode === "chat" && !run.compare) {
    history = [...run.history, { role: "user", content: run.prompt }, { role: "assistant", content: results[0].text }];
  }
}

// A run refused for its steering: when the server no longer has vectors the page lists (it restarted
// without them), re-read its list, take the run back (its prompt returns to the box) and say so.
// Returns whether it did.
async function forget(run) {
  let gone;
  try {
    gone = await refresh();
  } catch (e) {
    return false;
  }
  if (!gone.length) return false;
  if (run.compare) $("compare-output").replaceChildren();
  else if (run.mode === "raw") $("raw-output").textContent = "";
  else [1, 2].forEach(() => $("chat-log").lastChild.remove());  // this run's question and reply
  if (!$("prompt").value) $("prompt").value = run.prompt;
  last = null;
  busy(false);
  $("play-status").textContent = "";
  show(`${forgotten(gone)} Send again to run without ${gone.length > 1 ? "them" : "it"}.`, "error");
  return true;
}

export function setupPlay(state) {
  const send = () => {
    const prompt = $("prompt").value;
    if (!prompt.trim()) {
      show("The prompt is empty: type a message or a text to continue.", "error");
      return;
    }
    const run = { mode: mode(), compare: $("compare").checked, prompt, history: mode() === "chat" ? history : [] };
    const reqs = prepare(run, state);
    if (!reqs) return;  // the prompt stays for another try
    $("prompt").value = "";
    execute(run, reqs, state);
  };
  $("send").addEventListener("click", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => controllers.forEach((c) => c.abort()));
  $("regenerate").addEventListener("click", () => {
    if (!last) return;
    const run = { ...last, compare: $("compare").checked };
    const reqs = prepare(run, state);
    if (!reqs) return;
    if (last.mode === "chat" && !last.compare) {  // drop the reply (and its question) being redone
      history = last.history;
      const log = $("chat-log");
      log.lastChild && log.lastChild.remove();
      log.lastChild && log.lastChild.remove();
    }
    execute(run, reqs, state);
  });
  $("clear").addEventListener("click", () => {
    history = [];
    last = null;
    $("chat-log").replaceChildren();
    $("raw-output").textContent = "";
    $("compare-output").replaceChildren();
    busy(false);
  });
  for (const id of SAMPLING) $(id).addEventListener("input", () => $(id).classList.remove("invalid"));
  for (const id of ["mode-chat", "mode-raw", "compare"]) {
    $(id).addEventListener("change", () => {
      const compare = $("compare").checked;
      $("chat-log").hidden = compare || mode() !== "chat";
      $("raw-output").hidden = compare || mode() !== "raw";
      $("compare-output").hidden = !compare;
      $("prompt").placeholder = mode() === "chat" ? "Type a message (Enter sends, Shift+Enter for a new line)"
        : "Text to continue (Enter sends)";
    });
  }
  busy(false);
}
