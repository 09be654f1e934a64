// The playground's line charts as inline SVG (no assets to fetch): the sweep's probe and the
// evaluation's curve and side effects against strength.
const SVG = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  Object.entries(attrs).forEach(([k, v]) => node.setAttribute(k, v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// One series (xs[i], ys[i]) as an SVG line chart: a <path class="series"> through the finite points
// (a null y, not finite on the server, is left out) and a circle on each.
export function lineChart({ xs, ys, label, color, zero = false, width = 330, height = 230 }) {
  const W = width, H = height, L = 58, R = 14, T = 14, B = 40;
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
  if (x0 < 0 && 0 < x1) svg.append(el("line", { x1: X(0), x2: X(0), y1: T, y2: H - B, stroke: "#bbb" }));
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
