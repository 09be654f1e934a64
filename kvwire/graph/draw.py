"""`kw.plot`: draw a layer graph with Graphviz; inserted layers and cache wiring stand out."""
import operator
import shutil
from pathlib import Path

from torch import fx, nn

from ..layers.site import Site
from .cache import CachedGraph
from .trace import trace

INSERTED = "#ffb347"  # orange: layers an edit added
CACHED = "#9ecae1"    # blue: cache inputs, cached calls, next caches
INPUT = "#e5e5e5"
_RENDERED = {".svg", ".png", ".pdf"}
_SOURCE = {".dot", ".gv"}
_PLUMBING = ("positions", "cache_index", "attention_mask")


def plot(model, path=None, depth="block"):
    """Draw the layer graph of `model` and optionally write it to `path`.

    Args:
        model: a backbone or clone (drawn at `depth`), a `CausalLM` (its backbone) or a
            `CachedGraph` (drawn at layer depth with one cache input and one next-cache output
            per cached layer, and its runtime inputs).
        path: ".svg", ".png" or ".pdf" (rendered by Graphviz's `dot`), ".dot"/".gv" (source), or None.
        depth: "block" or "layer" for modules.

    Returns the `graphviz.Digraph`. Inserted layers are filled orange; cache wiring blue; layers
    of one decoder block are boxed together; bare block sites (identities) are not drawn.

    Example:
        >>> kw.plot(lm.steer(vec, 4.0).backbone, "steered.svg")
        >>> kw.plot(kw.with_cache(lm.backbone), "cached.svg")
    """
    import graphviz

    if hasattr(model, "backbone") and hasattr(model, "cached"):  # a CausalLM
        model = model.backbone
    if isinstance(model, CachedGraph):
        gm, inserted = model.graph_module, set()
    elif isinstance(model, nn.Module):
        gm = model if isinstance(model, fx.GraphModule) and depth == "block" else trace(model, depth=depth)
        inserted = set(getattr(model, "meta", {}).get("kvwire_inserted", ()))
    else:
        raise TypeError(f"plot expects an nn.Module, a CausalLM or a CachedGraph, got {type(model).__name__}")
    dot = _draw(gm, inserted, graphviz.Digraph(type(model).__name__))
    if path is not None:
        _write(dot, Path(path))
    return dot


def _draw(gm, inserted, dot):
    dot.attr(rankdir="TB")
    dot.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica", fontsize="11")
    alias = {}       # node -> the drawn node it stands for (getitem unpacking is not drawn)
    clusters = {}    # block name -> subgraph of its layer calls
    cache_slot = {}  # forward_cached node -> its cache index
    home = {}        # drawn node -> its block cluster key (ops join the block of their last input)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.target in _PLUMBING:  # read by every cached call: one note, no edges
                if node.target == "positions":
                    dot.node("plumbing", "positions · cache_index · attention_mask\n(read by every cached layer)",
                             shape="note", fillcolor=INPUT)
            elif node.target != "cache":
                dot.node(node.name, node.target, shape="ellipse", fillcolor=INPUT)
        elif node.op == "get_attr":
            continue
        elif node.op == "call_function" and node.target is operator.getitem:
            _draw_getitem(dot, node, alias, cache_slot)
        elif node.op == "call_module" and type(gm.get_submodule(node.target)) is Site:
            alias[node] = alias.get(node.args[0], node.args[0].name)  # a bare site only names a place
        elif node.op == "output":
            dot.node(node.name, "output", shape="ellipse", fillcolor=INPUT)
            _edges(dot, node, _outputs(node.args[0]), alias)
        else:
            target = node.args[0].target if node.op == "call_method" else node.target
            label, fill = _label(gm, node, target, inserted)
            if node.op == "call_method" and "cache" in node.kwargs:
                cache_slot[node] = node.kwargs["cache"].args[1]
            if node.op in ("call_module", "call_method"):
                home[node.name] = _block_of(target)
            else:
                home[node.name] = next((home.get(alias.get(a, a.name)) for a in reversed(_outputs(list(node.args)))
                                        if home.get(alias.get(a, a.name))), None)
            graph = _cluster(dot, clusters, home[node.name])
            graph.node(node.name, label, fillcolor=fill, shape="box" if node.op != "call_function" else "circle")
            args = node.args[1:] if node.op == "call_method" else node.args
            _edges(dot, node, list(args) + [v for k, v in node.kwargs.items() if k != "cache"], alias)
            if node in cache_slot:
                cache = f"cache_{cache_slot[node]}"
                dot.node(cache, f"cache[{cache_slot[node]}]\n(key, value)", shape="cylinder", fillcolor=CACHED)
                dot.edge(cache, node.name, color="#3182bd")
    for name, sub in clusters.items():
        dot.subgraph(sub)
    return dot


def _label(gm, node, target, inserted):
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)), "white"
    module = gm.get_submodule(target) if isinstance(target, str) else None
    cls = type(module).__name__ if module is not None else ""
    is_new = target in inserted or "__" in str(target).rsplit(".", 1)[-1]
    cached = node.op == "call_method" and "cache" in node.kwargs
    fill = INSERTED if is_new else CACHED if cached else "white"
    return f"{target}\n{cls}" + ("\n(cached)" if cached else ""), fill


def _draw_getitem(dot, node, alias, cache_slot):
    source, index = node.args
    if getattr(source, "op", None) == "call_method" and source in cache_slot and index == 1:
        name = f"next_cache_{cache_slot[source]}"
        dot.node(name, f"next cache[{cache_slot[source]}]", shape="cylinder", fillcolor=CACHED)
        dot.edge(source.name, name, color="#3182bd")
        alias[node] = name
    elif getattr(source, "op", None) == "placeholder" and source.target == "cache":
        alias[node] = None  # drawn with the layer that reads it
    else:
        alias[node] = alias.get(source, source.name)


def _outputs(value):
    """Flatten the output structure (tuples, dicts of taps) into nodes."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _outputs(v)]
    return []


def _edges(dot, node, inputs, alias):
    for arg in _outputs(list(inputs)):
        if arg.op == "get_attr":
            continue
        src = alias.get(arg, arg.name) if arg in alias else arg.name
        if src is None:
            continue
        if arg.op == "placeholder" and arg.target in _PLUMBING:
            continue
        if arg.op == "placeholder" and arg.target != "token_ids":  # runtime inputs
            dot.edge(src, node.name, style="dashed", color="#aaaaaa", constraint="false")
        else:
            dot.edge(src, node.name)


def _block_of(target):
    """'layers.3' for 'layers.3.mlp'; None for calls outside a numbered block."""
    parts = str(target).split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 and parts[1].isdigit() else None


def _cluster(dot, clusters, key):
    if key is None:
        return dot
    if key not in clusters:
        import graphviz
        clusters[key] = graphviz.Digraph(f"cluster_{key.replace('.', '_')}")
        clusters[key].attr(label=key, style="dashed", color="#999999", fontname="Helvetica")
    return clusters[key]


def _write(dot, path):
    suffix = path.suffix.lower()
    if suffix in _SOURCE:
        path.write_text(dot.source)
        return
    if suffix not in _RENDERED:
        raise ValueError(f"plot path must end in one of {sorted(_RENDERED | _SOURCE)}, got {path.name!r}")
    if shutil.which("dot") is None:
        raise RuntimeError(f"rendering {path.name} needs Graphviz's `dot` program (Debian: apt-get install "
                           f"graphviz); or write the source with a .dot path")
    dot.render(outfile=str(path), cleanup=True)
