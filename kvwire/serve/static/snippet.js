// The current request as a curl command and as Python with the openai client.
import { $ } from "./api.js";

function curl(req) {
  const body = JSON.stringify(req.body, null, 2).replace(/'/g, "'\\''");
  return `curl -sN ${location.origin}${req.path} -H 'content-type: application/json' -d '${body}'`;
}

function python(reqs, state) {
  const first = reqs[0];
  const { steer, messages, prompt, sae_features: features, sae_mode: mode, ...rest } = first.body;
  const sae = features ? `, "sae_features": ${py(features)}, "sae_mode": ${py(mode)}` : "";
  const args = Object.entries(rest).map(([k, v]) => `    ${k}=${py(v)},`);
  const chat = first.path.endsWith("chat/completions");
  const call = chat ? "client.chat.completions.create" : "client.completions.create";
  const input = chat ? `    messages=${py(messages)},` : `    prompt=${py(prompt)},`;
  const lines = ["from openai import OpenAI", "", `client = OpenAI(base_url="${location.origin}/v1", api_key="none")`];
  const read = chat ? "chunk.choices[0].delta.content or \"\"" : "chunk.choices[0].text";
  const body = (steerExpr, indent) => [
    `${indent}stream = ${call}(`, ...[input, ...args, `    extra_body={"steer": ${steerExpr}${sae}},  # kvwire's fields`, "    stream=True,"].map((l) => indent + l),
    `${indent})`, `${indent}for chunk in stream:`, `${indent}    if chunk.choices:`, `${indent}        print(${read}, end="", flush=True)`,
    `${indent}print()`];
  if (reqs.length === 1) return [...lines, ...body(py(steer), "")].join("\n");
  const name = $("compare-vector").value;
  const others = { ...steer };
  delete others[name];
  const values = reqs.map((r) => r.strength);
  const steerExpr = `{${Object.entries(others).map(([k, v]) => `${py(k)}: ${py(v)}, `).join("")}${py(name)}: s}`;
  return [...lines, `# one request per strength; sent concurrently they share the server's batch`,
    `for s in ${py(values)}:`, `    print(f"--- ${name} = {s}")`, ...body(steerExpr, "    ")].join("\n");
}

function py(value) {
  if (value === true) return "True";
  if (value === false) return "False";
  if (value === null || value === undefined) return "None";
  if (Array.isArray(value)) return `[${value.map(py).join(", ")}]`;
  if (typeof value === "object") return `{${Object.entries(value).map(([k, v]) => `${py(k)}: ${py(v)}`).join(", ")}}`;
  return JSON.stringify(value);
}

export function snippets(reqs, state) {
  $("snippet-curl").textContent = reqs.map(curl).join("\n\n");
  $("snippet-python").textContent = python(reqs, state);
}

function copy(id, button) {
  const text = $(id).textContent;
  const done = () => { button.textContent = "copied"; setTimeout(() => { button.textContent = "copy"; }, 1200); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => fallback(text, done));
  } else {
    fallback(text, done);
  }
}

function fallback(text, done) {
  const area = document.createElement("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  done();
}

document.querySelectorAll("[data-copy]").forEach((b) => b.addEventListener("click", () => copy(b.dataset.copy, b)));
