"""Where a steering operation goes: the call of a named site in numbered blocks.

Blocks of the shared decoder and GPT-2 have the sites of `kvwire.layers.site.SITES` as `Site`
children; a block made of another library's modules is one call at every depth, so `block_out` is
its call's output. `block_out` is edited after the block's own call while the graph still calls its
blocks (so block-level edits such as `kw.skip("layers.2")` keep working after a steer); a site
inside a block opens the blocks (a "layer" depth graph).
Sites inside a layer that is one call (attention's `attn_heads`; a generic block's residual sites)
are edited inside that call (`kvwire.layers.inner`): `inner_calls` finds the layer, `put_inside`
gives a clone its edited copy, under the same name.
"""
from ..layers.base import Block
from ..layers.site import ALL_SITES, Site
from .edit import numbered_blocks, summarize_indices
from .release import recompile
from .trace import layer_calls, trace


def site_calls(module, site, indices=None):
    """{block index: dotted name of the layer-depth call to edit after} for `site` in the blocks
    `indices` picks (None: every numbered block).

    Example:
        >>> site_calls(lm.backbone, "attn_out", [2])
        {2: 'layers.2.attn_out'}
    """
    blocks, picked = _picked(module, site, indices)
    out = {}
    for i in picked:
        call = _graph_site(module, blocks[i], site)
        if call is None:
            inside = inner_calls(module, site, [i])
            if inside:
                raise ValueError(f"site {site!r} of block {blocks[i]!r} is inside the call {inside[i]!r}; it "
                                 f"is edited inside that call (kvwire.graph.sites.inner_calls), not after a call")
            raise ValueError(f"block {blocks[i]!r} ({type(module.get_submodule(blocks[i])).__name__}) has no site "
                             f"{site!r}; its sites are {block_sites(module, blocks[i])}")
        out[i] = call
    return out


def _picked(module, site, indices):
    if site not in ALL_SITES:
        raise ValueError(f"site must be one of {ALL_SITES}, got {site!r}")
    blocks = numbered_blocks(module)
    picked = sorted(blocks) if indices is None else list(indices)
    missing = [i for i in picked if i not in blocks]
    if missing:
        raise ValueError(f"blocks {missing} are not blocks of this model: it has blocks "
                         f"{summarize_indices(blocks) or 'none'}")
    return blocks, picked


def _graph_site(module, name, site):
    """The call to edit after for `site` of block `name`, or None when the site is no graph call."""
    block = module.get_submodule(name)
    if isinstance(getattr(block, site, None), Site):
        return f"{name}.{site}"
    if site == "block_out" and (not isinstance(block, Block) or block.opaque):
        return name  # one call at every depth: its output is the block's output
    return None


def block_sites(module, name):
    """The sites block `name` of `module` has, graph sites and inner ones, in `ALL_SITES` order."""
    inner = {s for call in _leaves(module, name) for s in getattr(module.get_submodule(call), "inner_sites", ())}
    return [s for s in ALL_SITES if s in inner or _graph_site(module, name, s) is not None]


def _leaves(module, name):
    gm = trace(module, depth="layer")
    return [n.target for n in layer_calls(gm) if n.target == name or n.target.startswith(name + ".")]


def inner_calls(module, site, indices=None):
    """{block index: dotted name of the layer call holding `site` inside it} for the blocks `indices`
    picks, where the site is inside a one-call layer (`kvwire.layers.inner`); blocks where it is a
    graph call, or absent, are left out.

    Example:
        >>> inner_calls(lm.backbone, "attn_heads", [2])
        {2: 'layers.2.self_attn'}
    """
    blocks, picked = _picked(module, site, indices)
    gm = trace(module, depth="layer")
    out = {}
    for i in picked:
        if _graph_site(module, blocks[i], site) is not None:
            continue
        for node in layer_calls(gm):
            if (node.target == blocks[i] or node.target.startswith(blocks[i] + ".")) \
                    and site in getattr(gm.get_submodule(node.target), "inner_sites", ()):
                out[i] = node.target
                break
    return out


def put_inside(gm, site, layers, gate=None):
    """Give the clone `gm` (a graph made by `kw.clone`: its containers are its own) an edited copy of
    each layer call in `layers` ({dotted call: new layer}), with the new layer last at `site` inside
    it (`InnerSites.with_edit`), under the same name. gate: the call (dotted name) of a probe whose
    output gates the new layers: it becomes each edited call's second input. Returns gm."""
    for call, layer in layers.items():
        parent, _, attr = call.rpartition(".")
        holder = gm.get_submodule(parent) if parent else gm
        holder._modules[attr] = holder._modules[attr].with_edit(site, layer, gated=gate or False)
    if gate is None:
        return gm
    order = layer_calls(gm)
    probe = next(n for n in order if n.target == gate)
    for node in order:
        if node.target in layers:
            if order.index(node) < order.index(probe):
                raise ValueError(f"the gate's probe at {gate!r} comes after the gated operation inside {node.target!r}; "
                                 f"a probe must be read before what it gates")
            if len(node.args) > 1 and node.args[1] is not probe:
                raise ValueError(f"{node.target!r} is gated already by another probe; one layer's inner operations "
                                 f"take one gate")
            node.args = (node.args[0], probe)
    return recompile(gm)


def chain_ends(gm, call):
    """The last layer with runtime inputs chained after each call of `call` in the layer-depth graph
    `gm` (or the call itself), one per call in graph order: something new put at a site acts after
    what was put there before, in order, at every call (a block an edit calls twice has two)."""
    ends = []
    for node in (n for n in layer_calls(gm) if n.target == call):
        while len(node.users) == 1:
            user = next(iter(node.users))
            if user.op != "call_module" or not getattr(gm.get_submodule(user.target), "runtime_inputs", None) \
                    or user.args[:1] != (node,):
                break
            node = user
        if node.target not in ends:
            ends.append(node.target)
    return ends


def site_targets(module, site, indices, depth=None):
    """(depth, {block index: [calls to insert after]}) for `site` of the blocks `indices`, after what
    is chained there already (one call per call of the site: usually one). depth None: "block" for
    `block_out` of blocks the graph still calls, else "layer"; give "layer" to have every target at
    one depth with other layer-depth calls. A site inside a one-call layer gives ("inner",
    {block index: [that layer's call]}) whatever the depth asked (see `put_inside`).

    Example:
        >>> site_targets(lm.backbone, "block_out", [2])
        ('block', {2: ['layers.2']})
    """
    inside = inner_calls(module, site, indices)
    if inside:
        if len(inside) != len(indices):
            raise ValueError(f"site {site!r} is inside a layer in blocks {sorted(inside)} but not in blocks "
                             f"{sorted(set(indices) - set(inside))}; edit them apart")
        return "inner", {i: [call] for i, call in inside.items()}
    calls = site_calls(module, site, indices)
    if depth in (None, "block") and site == "block_out":
        blocks = numbered_blocks(module)
        gm = trace(module)
        called = {n.target for n in layer_calls(gm)}
        if all(blocks[i] in called for i in calls):
            return "block", {i: chain_ends(gm, blocks[i]) for i in calls}
    if depth == "block":
        raise ValueError(f"site {site!r} is inside the blocks: it is edited at 'layer' depth")
    gm = trace(module, depth="layer")
    return "layer", {i: chain_ends(gm, call) for i, call in calls.items()}
