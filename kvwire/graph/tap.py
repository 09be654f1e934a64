"""`kw.tap`: read the outputs of chosen layer calls in the same forward that computes the result."""
from .edit import _resolve
from .release import recompile
from .trace import layer_calls, trace


def tap(module, where, depth="block"):
    """A graph of `module` that also returns what the calls picked by `where` produce.

    Args:
        module: a backbone or a clone of one. where: a selector (see `kvwire.graph.edit`).
        depth: "block" or "layer".

    Returns a GraphModule: `token_ids (B, T) -> (hidden (B, T, D), {call name: output (B, T, D)})`.
    It shares weights with `module`; `kw.with_cache` accepts it (taps of a cached, batched run).

    Example:
        >>> tapped = kw.tap(backbone, "layers.2-4")
        >>> hidden, taps = tapped(ids)
        >>> taps["layers.3"].shape
        torch.Size([1, 5, 640])
    """
    gm = trace(module, depth=depth)
    picked = set(_resolve(gm, [n.target for n in layer_calls(gm)], where))
    taps, seen = {}, {}
    for node in layer_calls(gm):
        if node.target in picked:
            count = seen[node.target] = seen.get(node.target, 0) + 1
            taps[node.target if count == 1 else f"{node.target}#{count}"] = node
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((output.args[0], taps),)
    recompile(gm)
    return gm
