// The server's endpoints, the stream reader and the page's shared helpers (message banner,
// connection status, number parsing).
export const $ = (id) => document.getElementById(id);

export class ServerGone extends Error {}

// A message for the user from a failed response: OpenAI's error shape ({error: {message, param}})
// or text. The Error keeps the status and the field the server named (error.param).
async function failure(response) {
  let text = await response.text();
  let param = null;
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) ({ message: text, param = null } = body.error);
  } catch (e) { /* not JSON: keep the text */ }
  return Object.assign(new Error(`${text || response.statusText} (HTTP ${response.status})`),
    { status: response.status, param });
}

// A server started with --api-key answers 401 without "Authorization: Bearer KEY": the page asks
// for the key once, keeps it for this tab (sessionStorage) and sends it on every call.
const KEY = "kvwire-api-key";

function withKey(options, key) {
  return key ? { ...options, headers: { ...(options.headers || {}), authorization: `Bearer ${key}` } } : options;
}

function askForKey(refused) {
  const key = window.prompt(refused ? "The server refused that API key. API key:"
    : "This server needs an API key (kvwire serve --api-key). API key:");
  if (key === null || !key.trim()) return false;
  sessionStorage.setItem(KEY, key.trim());
  return true;
}

async function call(path, options = {}) {
  for (;;) {
    const sent = sessionStorage.getItem(KEY);
    let response;
    try {
      response = await fetch(path, withKey(options, sent));
    } catch (e) {
      if (options.signal && options.signal.aborted) throw e;  // Stop before the reply began: not a lost server
      lost(e);
      throw new ServerGone(`cannot reach the server (${e.message})`);
    }
    // another call may have been given a key meanwhile (compare mode sends several): retry with it
    if (response.status === 401 && (sessionStorage.getItem(KEY) !== sent || askForKey(sent !== null))) continue;
    if (!response.ok) throw await failure(response);
    return response;
  }
}

// Save a file the server sends (a vector's GGUF) through `call`, so the key goes with it.
export async function download(path, filename) {
  const blob = await (await call(path)).blob();
  const link = Object.assign(document.createElement("a"), { href: URL.createObjectURL(blob), download: filename });
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

export async function getJSON(path) { return (await call(path)).json(); }

export async function postJSON(path, body, signal) {
  return (await call(path, { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify(body), signal })).json();
}

// POST a streaming request; onEvent(obj) for each server-sent event until [DONE]. A stream that
// breaks (or ends without [DONE]) raises ServerGone; an {error} event raises Error.
export async function stream(path, body, signal, onEvent) {
  const response = await call(path, { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ ...body, stream: true }), signal });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      if (signal && signal.aborted) return "stopped";
      lost(e);
      throw new ServerGone(`the server went away mid-stream (${e.message})`);
    }
    if (chunk.done) {
      lost(new Error("the stream ended early"));
      throw new ServerGone("the server went away mid-stream (the stream ended before [DONE])");
    }
    buffer += decoder.decode(chunk.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return "done";
      const obj = JSON.parse(data);
      if (obj.error) throw new Error(obj.error.message);
      onEvent(obj);
    }
  }
}

// The banner under the header: kind "error" or "info"; show("") hides it.
export function show(text, kind = "info") {
  const box = $("message");
  box.textContent = text;
  box.className = `message ${kind}`;
  box.hidden = !text;
}

// A measuring tab's Run (the sweep, the evaluation): `request()` builds the body (an Error it throws
// is shown as the page's error), then the body is posted to `path` with the `${prefix}-button` off
// and "measuring N strengths…" in `${prefix}-status`, and `draw` gets the answer.
export async function measure(prefix, request, path, draw, failed) {
  let body;
  try {
    body = request();
  } catch (e) {
    show(e.message, "error");
    return;
  }
  show("");
  $(`${prefix}-button`).disabled = true;
  $(`${prefix}-status`).textContent = `measuring ${body.strengths.length} strengths…`;
  try {
    draw(await postJSON(path, body));
  } catch (e) {
    show(`${failed}: ${e.message}`, "error");
  } finally {
    $(`${prefix}-status`).textContent = "";
    $(`${prefix}-button`).disabled = false;
  }
}

// When the server stops answering: say so, poll /health until it answers, then say that too.
let polling = null;
const backListeners = [];
export function onBack(fn) { backListeners.push(fn); }

function lost(error) {
  const pill = $("connection");
  pill.textContent = "server unreachable";
  pill.className = "pill down";
  if (polling) return;
  show(`Lost the connection to the server (${error.message}). Waiting for it to come back…`, "error");
  polling = setInterval(async () => {
    try {
      const r = await fetch("/health", { cache: "no-store" });
      if (!r.ok) return;
    } catch (e) { return; }
    clearInterval(polling);
    polling = null;
    pill.textContent = "connected";
    pill.className = "pill ok";
    show("The server is back. Press Regenerate to run the interrupted request again.");
    backListeners.forEach((fn) => fn());
  }, 1000);
}

const NUMBER = /^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$/;

// A number typed in a box, or an Error saying what was expected. `above`: an exclusive lower bound
// (the range reads "(above, max]", as the server's messages do).
export function parseNumber(text, what, { integer = false, min = -Infinity, max = Infinity, above = null } = {}) {
  const t = String(text).trim();
  if (!NUMBER.test(t) || !Number.isFinite(Number(t))) {
    throw new Error(`${what} must be a number${integer ? " (a whole one)" : " like 0.5 or -1"}, got "${t}"`);
  }
  const value = Number(t);
  if (integer && !Number.isInteger(value)) throw new Error(`${what} must be a whole number, got "${t}"`);
  if (above !== null && !(value > above && value <= max)) {
    throw new Error(`${what} must lie in (${above}, ${max}], got ${value}`);
  }
  if (value < min || value > max) throw new Error(`${what} must lie in [${min}, ${max}], got ${value}`);
  return value;
}

export function parseList(text, what) {
  const parts = String(text).split(",").map((s) => s.trim()).filter((s) => s);
  if (!parts.length) throw new Error(`${what} is empty: give numbers separated by commas, like -1, 0, 1`);
  return parts.map((p) => parseNumber(p, `each of ${what}`));
}
