// The served model's layer graph (kw.plot's SVG): inserted Steer layers are orange; choosing a
// vector outlines its own layers.
import { $, getJSON, show } from "./api.js";

let shown = null;  // the server's graph version on screen
let nodes = {};    // graph node -> vector name

function highlight() {
  const name = $("graph-vector").value;
  const picked = [];
  document.querySelectorAll("#graph-view g.node").forEach((g) => {
    const title = g.querySelector("title");
    const owner = title && nodes[title.textContent];
    g.classList.toggle("highlight", Boolean(owner) && owner === name);
    if (owner === name) picked.push(title.textContent);
  });
  const owners = {};
  Object.entries(nodes).forEach(([node, v]) => { (owners[v] = owners[v] || []).push(node); });
  $("graph-legend").textContent = Object.keys(owners).length
    ? Object.entries(owners).map(([v, ns]) => `${v}: ${ns.length} layer${ns.length > 1 ? "s" : ""}`).join(" · ")
    : "no steering layers";
}

export async function loadGraph(state) {
  if (!state.info || shown === state.info.version) return;
  try {
    const graph = await getJSON("/kvwire/graph");
    const view = $("graph-view");
    view.innerHTML = graph.svg.slice(graph.svg.indexOf("<svg"));
    nodes = graph.steer_nodes;
    document.querySelectorAll("#graph-view g.node").forEach((g) => {
      const title = g.querySelector("title");
      if (title && nodes[title.textContent]) g.dataset.vector = nodes[title.textContent];
    });
    shown = graph.version;
    highlight();
  } catch (e) {
    $("graph-view").textContent = "";
    show(`Could not draw the graph: ${e.message}`, "error");
  }
}

export function setupGraph() {
  $("graph-vector").addEventListener("change", highlight);
}
