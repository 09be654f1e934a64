// SAE features (a server started with --sae): rows of a feature index and its value (for "clamp",
// lo and hi; blank: unbounded), sent with each request as "sae_features" and "sae_mode".
import { $, parseNumber } from "./api.js";

let sae = null;  // the server's SAE (/kvwire/info's "sae"), or null

function rows() { return [...document.querySelectorAll("#sae-list li")]; }

function clampMode() { return $("sae-mode").value === "clamp"; }

// Show the hi box and the lo/value placeholder that the mode asks for.
function shape() {
  for (const li of rows()) {
    li.querySelector(".sae-hi").hidden = !clampMode();
    li.querySelector(".sae-value").placeholder = clampMode() ? "lo" : "value";
  }
  $("sae-add").disabled = !sae || rows().length >= sae.per_request;
}

function addRow() {
  const li = document.createElement("li");
  li.innerHTML = `<input class="sae-index" type="text" inputmode="numeric" placeholder="index">
    <input class="sae-value" type="text" inputmode="decimal"><input class="sae-hi" type="text" inputmode="decimal"
    placeholder="hi"><button class="sae-remove" title="remove this feature">×</button>`;
  li.querySelectorAll("input").forEach((box) => box.addEventListener("input", () => box.classList.remove("invalid")));
  li.querySelector(".sae-remove").addEventListener("click", () => { li.remove(); shape(); });
  $("sae-list").append(li);
  shape();
  return li;
}

// The number in `box` (blank: null where `optional`); the box is marked while it holds a bad value.
function read(box, what, options, optional = false) {
  if (optional && !box.value.trim()) return null;
  try {
    return parseNumber(box.value, what, options);
  } catch (e) {
    box.classList.add("invalid");
    throw e;
  }
}

// The request's SAE fields: {sae_features, sae_mode}, or {} without features; throws naming a bad box.
export function saeFields() {
  if (!sae) return {};
  const features = {};
  for (const li of rows()) {
    const index = li.querySelector(".sae-index");
    const value = li.querySelector(".sae-value");
    if (!index.value.trim() && !value.value.trim() && !li.querySelector(".sae-hi").value.trim()) continue;
    const i = read(index, "an SAE feature index", { integer: true, min: 0, max: sae.d_sae - 1 });
    if (String(i) in features) {
      index.classList.add("invalid");
      throw new Error(`SAE feature ${i} is listed twice`);
    }
    if (clampMode()) {
      const lo = read(value, `lo of SAE feature ${i}`, {}, true);
      const hi = read(li.querySelector(".sae-hi"), `hi of SAE feature ${i}`, {}, true);
      if (lo !== null && hi !== null && lo > hi) {
        value.classList.add("invalid");
        throw new Error(`the bounds of SAE feature ${i} are inverted: lo ${lo} > hi ${hi}`);
      }
      features[i] = [lo, hi];
    } else {
      features[i] = read(value, `the value of SAE feature ${i}`);
    }
  }
  return Object.keys(features).length ? { sae_features: features, sae_mode: $("sae-mode").value } : {};
}

// Show the section when the server has an SAE (`info`: /kvwire/info's "sae"), with one empty row.
export function renderSae(info) {
  sae = info || null;
  $("sae-section").hidden = !sae;
  if (!sae) return;
  if ($("sae-mode").options.length !== sae.modes.length) {
    $("sae-mode").replaceChildren(...sae.modes.map((m) => new Option(m, m)));
  }
  $("sae-hint").textContent = `${sae.d_sae} features at ${sae.site} of block ${sae.layer}; at most ` +
    `${sae.per_request} per request. "set" holds a feature at the value, "add" adds to it, "clamp" keeps it in ` +
    `[lo, hi].`;
  if (!rows().length) addRow();
  shape();
}

export function setupSae() {
  $("sae-add").addEventListener("click", () => addRow());
  $("sae-mode").addEventListener("change", shape);
}
