// The chosen vector measured: POST /kvwire/evaluate (kw.steer.evaluate on the served base model)
// drawn as SVG charts, the behaviour curve (mean A/B logit difference against strength) and the side
// effects (KL from the unsteered model, perplexity change on neutral text), with the numbers in a table.
import { $, measure, parseList } from "./api.js";
import { lineChart } from "./chart.js";

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
  if ($("eval-generated-only").checked) body.generated_only = true;
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
