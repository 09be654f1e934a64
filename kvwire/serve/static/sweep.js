// A sweep on the page: POST /kvwire/sweep (kw.steer.sweep on the served base model), drawn as an
// SVG chart of the probe against strength and a table of the samples.
import { $, measure, parseList } from "./api.js";

const SVG = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  Object.entries(attrs).forEach(([k, v]) => node.setAttribute(k, v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// Draw the (strength, value) points; values may be null (not finite).
export function chart(data) {
  const W = 640, H = 300, L = 60, R = 20, T = 20, B = 44;
  const pts = data.strengths.map((s, i) => [s, data.values[i]]).filter(([, v]) => v !== null);
  const xs = data.strengths, ys = pts.map(([, v]) => v);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = ys.length ? [Math.min(...ys), Math.max(...ys)] : [0, 1];
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.08;
  y0 -= pad; y1 += pad;
  const X = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  svg.append(el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fafafa", stroke: "#ccc" }));
  for (let k = 0; k <= 4; k++) {
    const y = y0 + (k / 4) * (y1 - y0);
    svg.append(el("line", { x1: L, x2: W - R, y1: Y(y), y2: Y(y), stroke: "#eee" }));
    svg.append(el("text", { x: L - 6, y: Y(y) + 4, "text-anchor": "end", "font-size": 11 }, y.toFixed(2)));
  }
  xs.forEach((x) => svg.append(el("text", { x: X(x), y: H - B + 16, "text-anchor": "middle", "font-size": 11 }, String(x))));
  if (x0 <= 0 && 0 <= x1) svg.append(el("line", { x1: X(0), x2: X(0), y1: T, y2: H - B, stroke: "#bbb" }));
  svg.append(el("polyline", { points: pts.map(([x, y]) => `${X(x)},${Y(y)}`).join(" "), fill: "none",
    stroke: "#d9822b", "stroke-width": 2.5 }));
  pts.forEach(([x, y]) => svg.append(el("circle", { cx: X(x), cy: Y(y), r: 4.5, fill: "#d9822b", class: "point",
    "data-strength": x, "data-value": y })));
  svg.append(el("text", { x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle", "font-size": 12 }, "strength"));
  svg.append(el("text", { x: 14, y: (T + H - B) / 2, "text-anchor": "middle", "font-size": 12,
    transform: `rotate(-90 14 ${(T + H - B) / 2})` }, data.probe));
  return svg;
}

function table(data) {
  const rows = data.strengths.map((s, i) => {
    const tr = document.createElement("tr");
    const v = data.values[i];
    [s.toFixed(2), v === null ? "not finite" : v.toFixed(3), data.prompt + data.samples[i]].forEach((t, j) => {
      const td = document.createElement("td");
      td.textContent = t;
      if (j < 2) td.className = "num";
      tr.append(td);
    });
    return tr;
  });
  const head = document.createElement("tr");
  ["strength", "probe", "sample"].forEach((t) => { const th = document.createElement("th"); th.textContent = t; head.append(th); });
  $("sweep-table").replaceChildren(head, ...rows);
}

const words = (text) => text.split(",").map((w) => w.trim()).filter((w) => w).map((w) => ` ${w}`);

function request() {
  const vector = $("sweep-vector").value;
  if (!vector) throw new Error("a sweep needs a control vector: load or train one first");
  const body = { vector, strengths: parseList($("sweep-strengths").value, "the sweep strengths"),
    prompt: $("sweep-prompt").value || undefined };
  const pos = words($("sweep-positive").value), neg = words($("sweep-negative").value);
  if (pos.length !== 0 || neg.length !== 0) {
    if (!pos.length || !neg.length) throw new Error("give both positive and negative words, or neither (the default: happy vs sad)");
    Object.assign(body, { positive_words: pos, negative_words: neg });
  }
  return body;
}

function draw(data) {
  $("sweep-chart").replaceChildren(chart(data));
  table(data);
}

const run = () => measure("sweep", request, "/kvwire/sweep", draw, "The sweep failed");

export function setupSweep() {
  $("sweep-button").addEventListener("click", run);
}
