// A sweep on the page: POST /kvwire/sweep (kw.steer.sweep on the served base model), drawn as an
// SVG chart of the probe against strength and a table of the samples.
import { $, measure, parseList } from "./api.js";
import { lineChart } from "./chart.js";

// The probe against strength; values may be null (not finite).
export function chart(data) {
  return lineChart({ xs: data.strengths, ys: data.values, label: data.probe, color: "#d9822b", width: 640, height: 300 });
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
