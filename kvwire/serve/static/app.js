// The page: tabs, the model and its control vectors (a slider and a number box each; a vector made
// to clamp has lo and hi boxes instead), SAE features, sampling settings; the tabs' own code is in
// play.js, train.js, graph.js, sweep.js and evaluate.js, the SAE features' in sae.js.
import { $, download, getJSON, onBack, parseNumber, show } from "./api.js";
import { setupPlay } from "./play.js";
import { renderSae, setupSae } from "./sae.js";
import { setupTrain } from "./train.js";
import { loadGraph, setupGraph } from "./graph.js";
import { setupSweep } from "./sweep.js";
import { renderDatasets, setupEvaluate } from "./evaluate.js";

export const state = { info: null, strengths: {} };

function setupTabs() {
  document.querySelectorAll("#tabs button").forEach((button) => {
    button.addEventListener("click", () => {
      document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b === button));
      document.querySelectorAll(".tab").forEach((t) => { t.hidden = t.id !== `tab-${button.dataset.tab}`; });
      if (button.dataset.tab === "graph") loadGraph(state);
    });
  });
}

// The strength of each vector as the request should carry it, and for a vector made to clamp its
// bounds {lo, hi} (a blank box: unbounded; both blank: left out); throws on a box that holds no number.
export function strengths() {
  const out = {};
  for (const v of state.info.vectors) {
    if (v.operation === "clamp") {
      const bounds = clampBounds(v.name);
      if (Object.keys(bounds).length) out[v.name] = bounds;
    } else {
      const box = $(`strength-box-${v.name}`);
      out[v.name] = parseNumber(box.value, `the strength of "${v.name}"`);
    }
  }
  return out;
}

function clampBounds(name) {
  const bounds = {};
  for (const side of ["lo", "hi"]) {
    const box = $(`${side}-box-${name}`);
    box.classList.remove("invalid");
    if (!box.value.trim()) continue;
    try {
      bounds[side] = parseNumber(box.value, `${side} of "${name}"`);
    } catch (e) {
      box.classList.add("invalid");
      throw e;
    }
  }
  if (bounds.lo !== undefined && bounds.hi !== undefined && bounds.lo > bounds.hi) {
    $(`lo-box-${name}`).classList.add("invalid");
    throw new Error(`the bounds of "${name}" are inverted: lo ${bounds.lo} > hi ${bounds.hi}`);
  }
  return bounds;
}

// A vector made to clamp: lo and hi boxes (blank: unbounded) instead of a strength.
function clampControls(li, v) {
  const kept = state.strengths[v.name] || {};
  li.querySelector(".controls").innerHTML = `<label>lo <input type="text" inputmode="decimal"
    placeholder="none"></label> <label>hi <input type="text" inputmode="decimal" placeholder="none"></label>`;
  li.querySelectorAll(".controls input").forEach((box, k) => {
    const side = ["lo", "hi"][k];
    box.id = `${side}-box-${v.name}`;
    box.value = kept[side] ?? "";
    box.title = `the projection on "${v.name}" is held at or ${side === "lo" ? "above" : "below"} this`;
    box.addEventListener("input", () => {
      state.strengths[v.name] = { ...(state.strengths[v.name] || {}), [side]: box.value };
      box.classList.remove("invalid");
    });
  });
}

function vectorItem(v) {
  const li = document.createElement("li");
  li.dataset.name = v.name;
  const value = state.strengths[v.name] ?? "0";
  li.innerHTML = `<div class="head"><span class="name"></span>
      <a class="download" title="llama.cpp control-vector GGUF">GGUF</a></div>
    <div class="controls"><input type="range" min="-2" max="2" step="0.05">
      <input type="text" inputmode="decimal"></div><div class="hint layers"></div>`;
  if (v.operation === "clamp") clampControls(li, v);
  li.querySelector(".name").textContent = v.name;
  const link = li.querySelector(".download");
  link.href = `/kvwire/vectors/${encodeURIComponent(v.name)}.gguf`;
  link.download = `${v.name}.gguf`;
  link.addEventListener("click", (event) => {  // fetched, so a server's API key goes with it
    event.preventDefault();
    download(link.href, link.download).catch((e) => show(e.message, "error"));
  });
  const acts = v.operation !== "add" || v.site !== "block_out" ? ` · ${v.operation} at ${v.site}` : "";
  li.querySelector(".layers").textContent = `blocks ${blocks(v.layers)}` + (v.method ? ` · ${v.method}` : "") + acts;
  if (v.operation === "clamp") return li;
  const slider = li.querySelector("input[type=range]");
  const box = li.querySelector("input[type=text]");
  slider.id = `strength-${v.name}`;
  box.id = `strength-box-${v.name}`;
  slider.setAttribute("aria-label", `strength of ${v.name}`);
  box.value = value;
  slider.value = Number.isFinite(Number(value)) ? value : 0;
  slider.addEventListener("input", () => {
    box.value = slider.value;
    box.classList.remove("invalid");
    state.strengths[v.name] = box.value;
  });
  box.addEventListener("input", () => {
    state.strengths[v.name] = box.value;
    try {
      slider.value = parseNumber(box.value, v.name);
      box.classList.remove("invalid");
    } catch (e) {
      box.classList.add("invalid");
    }
  });
  return li;
}

export function blocks(layers) {
  if (!layers.length) return "none";
  const contiguous = layers.every((l, i) => i === 0 || l === layers[i - 1] + 1);
  return contiguous && layers.length > 2 ? `${layers[0]}-${layers[layers.length - 1]}` : layers.join(", ");
}

// (Re)load the model's description and draw the vector list and the vector pickers. Returns the
// names listed before that the server no longer has (a restarted server forgets trained vectors).
export async function refresh() {
  const before = state.info ? state.info.vectors.map((v) => v.name) : [];
  state.info = await getJSON("/kvwire/info");
  const gone = before.filter((n) => !state.info.vectors.some((v) => v.name === n));
  gone.forEach((n) => delete state.strengths[n]);
  $("model-name").textContent = `${state.info.model} · context ${state.info.max_length}`;
  const list = $("vector-list");
  list.replaceChildren(...state.info.vectors.map(vectorItem));
  $("no-vectors").hidden = state.info.vectors.length > 0;
  for (const id of ["compare-vector", "sweep-vector", "graph-vector", "eval-vector"]) {
    const select = $(id);
    const keep = select.value;
    // comparing and sweeping vary a strength: a vector made to clamp has bounds instead (an
    // evaluation's strength of one is the value its projection is held at)
    const every = id === "graph-vector" || id === "eval-vector";
    const names = state.info.vectors.filter((v) => every || v.operation !== "clamp").map((v) => v.name);
    const options = id === "graph-vector" ? ["(none)", ...names] : names;
    select.replaceChildren(...options.map((n) => new Option(n, n)));
    if (options.includes(keep)) select.value = keep;
  }
  const method = $("train-method");
  if (!method.options.length) {
    method.replaceChildren(...state.info.methods.map((m) => new Option(m, m)));
    method.value = state.info.default_method;  // ControlVector.train's default, as the CLI's
  }
  for (const [id, values, first] of [["train-site", state.info.sites, "block_out"],
                                     ["train-operation", state.info.operations, "add"]]) {
    const select = $(id);
    if (!select.options.length) {
      select.replaceChildren(...values.map((v) => new Option(v, v)));
      select.value = first;
    }
  }
  renderSae(state.info.sae);
  renderDatasets(state.info.datasets || []);
  return gone;
}

// What the page says of vectors the server no longer has.
export function forgotten(gone) {
  const names = gone.map((n) => `"${n}"`).join(", ");
  return `The server no longer has the control vector${gone.length > 1 ? "s" : ""} ${names} (it may have ` +
    `restarted): removed from the list.`;
}

async function main() {
  setupTabs();
  setupPlay(state);
  setupTrain(state);
  setupGraph(state);
  setupSweep(state);
  setupEvaluate();
  setupSae();
  onBack(() => refresh().then((gone) => {
    if (gone.length) show(`The server is back. ${forgotten(gone)} Press Regenerate to run the request again.`);
  }).catch((e) => show(e.message, "error")));
  try {
    await refresh();
    document.body.dataset.ready = "1";
  } catch (e) {
    show(`Could not load the model's description: ${e.message}`, "error");
  }
}

main();
