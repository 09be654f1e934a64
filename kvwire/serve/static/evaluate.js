// The chosen vector measured: POST /kvwire/evaluate (kw.steer.evaluate on the served base model)
// drawn as SVG charts, the behaviour curve (mean A/B logit difference against strength) and the side
// effects (KL from the unsteered model, perplexity change on neutral text), with the numbers in a table.
import { $, measure, parseList } from "./api.js";

const SVG = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  Object.entries(attrs).forEach(([k, v]) => node.setAttribute(k, v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// One series (xs[i], ys[i]) as an SVG line chart: a <path class="series"> through the finite points
// (a null y, not finite on the server, is left out) and a circle on each.
export function lineChart({ xs, ys, label, color, zero = false }) {
  const W = 330, H = 230, L = 58, R = 14, T = 14, B = 40;
  const pts = xs.map((x, i) => [x, ys[i]]).filter(([, y]) => y !== null);
  const values = pts.map(([, y]) => y).concat(zero ? [0] : []);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = values.length ? [Math.min(...values), Math.max(...values)] : [0, 1];
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.08;
  y0 -= pad; y1 += pad;
  const X = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": label });
  svg.append(el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fafafa", stroke: "#ccc" }));
  for (let k = 0; k <= 4; k++) {
    const y = y0 + (k / 4) * (y1 - y0);
    svg.append(el("line", { x1: L, x2: W - R, y1: Y(y), y2: Y(y), stroke: "#eee" }));
    svg.append(el("text", { x: L - 6, y: Y(y) + 4, "text-anchor": "end", "font-size": 11 }, tick(y)));
  }
  xs.forEach((x) => svg.append(el("text", { x: X(x), y: H - B + 16, "text-anchor": "middle", "font-size": 11 }, String(x))));
  if (y0 <= 0 && 0 <= y1) svg.append(el("line", { x1: L, x2: W - R, y1: Y(0), y2: Y(0), stroke: "#bbb" }));
  const d = pts.map(([x, y], i) => `${i ? "L" : "M"}${X(x).toFixed(2)},${Y(y).toFixed(2)}`).join(" ");
  svg.append(el("path", { d, fill: "none", stroke: color, "stroke-width": 2.5, class: "series" }));
  pts.forEach(([x, y]) => svg.append(el("circle", { cx: X(x), cy: Y(y), r: 4, fill: color, class: "point",
    "data-strength": x, "data-value": y })));
  svg.append(el("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", "font-size": 12 }, "strength"));
  svg.append(el("text", { x: 14, y: (T + H - B) / 2, "text-anchor": "middle", "font-size": 12,
    transform: `rotate(-90 14 ${(T + H - B) / 2})` }, label));
  return svg;
}

function tick(y) {
  const a = Math.abs(y);
  return a !== 0 && (a < 0.01 || a >= 1e4) ? y.toExponential(1) : y.toFixed(a < 1 ? 3 : 2);
}

// A number as the table shows it: 4 significant digits (the exact value is in data-value).
function shown(v) {
  return v === null ? "not finite" : Math.abs(v) >= 1e-3 || v === 0 ? Number(v.toPrecision(4)).toString() : v.toExponential(3);
}

export const COLUMNS = [["strength", "strengths"], ["logit diff", "logit_diff"], ["KL (nats/token)", "kl"],
  ["perplexity", "perplexity"], ["perplexity change", "ppl_increase"]];

function table(data) {
  const head = document.createElement("tr");
  COLUMNS.forEach(([title]) => { const th = document.createElement("th"); th.textContent = title; head.append(th); });
  const rows = data.strengths.map((_, i) => {
    const tr = document.createElement("tr");
    COLUMNS.forEach(([, key]) => {
      const td = document.createElement("td");
      const v = data[key][i];
      td.textContent = shown(v);
      td.className = "num";
      td.dataset.key = key;
      td.dataset.value = v === null ? "" : String(v);
      tr.append(td);
    });
    return tr;
  });
  $("eval-table").replaceChildren(head, ...rows);
}

function summary(data) {
  const anti = Math.round(100 * data.anti_steerable);
  return `${data.operation} on ${data.dataset} (${data.per_example.length} examples): slope ` +
    `${shown(data.slope_mean)} ± ${shown(data.slope_std)} logit difference per unit strength, ${anti}% of examples ` +
    `anti-steerable; unsteered perplexity ${shown(data.base_perplexity)} over ${data.neutral_tokens} neutral tokens.`;
}

// The A/B examples typed as JSONL (one {"prompt", "positive", "negative"} a line).
function examples(text) {
  const lines = text.split(/\r?\n/).map((l) => l.trim());
  const out = [];
  lines.forEach((line, n) => {
    if (!line) return;
    try {
      out.push(JSON.parse(line));
    } catch (e) {
      throw new Error(`examples line ${n + 1} is not JSON (${e.message}); expected {"prompt": ..., "positive": ..., "negative": ...}`);
    }
  });
  if (!out.length) throw new Error('the examples are empty: give one {"prompt", "positive", "negative"} object a line');
  return out;
}

function request() {
  const vector = $("eval-vector").value;
  if (!vector) throw new Error("an evaluation needs a control vector: load or train one first");
  const body = { vector, strengths: parseList($("eval-strengths").value, "the evaluation strengths") };
  if (body.strengths.length < 2) throw new Error("give at least two strengths (a slope needs two)");
  if ($("eval-dataset").value === "custom") body.examples = examples($("eval-examples").value);
  else body.dataset = $("eval-dataset").value;
  const neutral = $("eval-neutral").value;
  if (neutral.trim()) body.neutral = neutral;
  return body;
}

function draw(data) {
  const xs = data.strengths;
  $("eval-curve").replaceChildren(lineChart({ xs, ys: data.logit_diff, label: "logit difference", color: "#d9822b", zero: true }));
  $("eval-kl").replaceChildren(lineChart({ xs, ys: data.kl, label: "KL (nats/token)", color: "#2b6cd9", zero: true }));
  $("eval-ppl").replaceChildren(lineChart({ xs, ys: data.ppl_increase, label: "perplexity / unsteered − 1", color: "#8a2bd9", zero: true }));
  table(data);
  $("eval-summary").textContent = summary(data);
}

const run = () => measure("eval", request, "/kvwire/evaluate", draw, "The evaluation failed");

// The dataset picker: the server's shipped sets, and "your examples" (shows the JSONL box).
export function renderDatasets(names) {
  const select = $("eval-dataset");
  const keep = select.value;
  select.replaceChildren(...names.map((n) => new Option(n, n)), new Option("your examples (JSONL)", "custom"));
  if ([...select.options].some((o) => o.value === keep)) select.value = keep;
  $("eval-examples").hidden = select.value !== "custom";
}

export function setupEvaluate() {
  $("eval-button").addEventListener("click", run);
  $("eval-dataset").addEventListener("change", () => { $("eval-examples").hidden = $("eval-dataset").value !== "custom"; });
}
