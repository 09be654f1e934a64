// Train a control vector from the page: paired prompts (pasted or from files), layers, method;
// the job is polled until the vector joins the served model and gets its slider.
import { $, getJSON, postJSON, show } from "./api.js";
import { refresh } from "./app.js";

const lines = (text) => text.split(/\r?\n/).map((l) => l.trim()).filter((l) => l);

function readFile(input, area) {
  input.addEventListener("change", () => {
    const file = input.files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => { area.value = reader.result; };
    reader.onerror = () => show(`Could not read ${file.name}: ${reader.error}`, "error");
    reader.readAsText(file);
  });
}

function status(text, running) {
  $("train-status").textContent = text;
  $("train-progress").hidden = !running;
  $("train-button").disabled = running;
}

// What the page can tell before asking the server (the server checks everything again).
function request() {
  const positive = lines($("train-positive").value);
  const negative = lines($("train-negative").value);
  for (const [side, list] of [["positive", positive], ["negative", negative]]) {
    if (!list.length) throw new Error(`The ${side} examples are empty: give one prompt per line (or pick a file).`);
  }
  if (positive.length !== negative.length) {
    throw new Error(`The lists must pair up: ${positive.length} positive and ${negative.length} negative prompts ` +
      `(line i of one pairs with line i of the other).`);
  }
  const layers = $("train-layers").value.trim();
  return { name: $("train-name").value.trim(), positive, negative, method: $("train-method").value,
    site: $("train-site").value, operation: $("train-operation").value, ...(layers ? { layers } : {}) };
}

async function train() {
  let body;
  try {
    body = request();
  } catch (e) {
    show(e.message, "error");
    status("", false);
    return;
  }
  show("");
  status(`starting: ${body.positive.length} pairs…`, true);
  let job;
  try {
    job = await postJSON("/kvwire/train", body);
    while (job.state !== "done" && job.state !== "error") {
      status(`${job.message} (${job.seconds.toFixed(1)} s)`, true);
      await new Promise((r) => setTimeout(r, 300));
      job = await getJSON(`/kvwire/jobs/${job.id}`);
    }
  } catch (e) {
    show(`Training did not start: ${e.message}`, "error");
    status("", false);
    return;
  }
  if (job.state === "error") {
    show(`Training ${body.name} failed: ${job.error}`, "error");
    status("", false);
    return;
  }
  status(`trained "${job.name}" in ${job.seconds.toFixed(1)} s: blocks ${job.vector.layers.join(", ")}`, false);
  show(`The control vector "${job.name}" is ready: move its slider, or download it as GGUF.`);
  await refresh();
}

export function setupTrain() {
  readFile($("train-positive-file"), $("train-positive"));
  readFile($("train-negative-file"), $("train-negative"));
  $("train-button").addEventListener("click", train);
}
