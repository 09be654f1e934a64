"""Where a steering operation goes: the call of a named site in numbered blocks.

Blocks of the shared decoder and GPT-2 have the sites of `kvwire.layers.site.SITES` as `Site`
children; a block without them (one made of another library's modules, called as one layer) has
its output, `block_out`, only. `block_out` is edited after the block's own call while the graph
still calls its blocks (so block-level edits such as `kw.skip("layers.2")` keep working after a
steer); an inner site opens the blocks (a "layer" depth graph).
"""
from ..layers.base import Block
from ..layers.site import SITES, Site
from .edit import numbered_blocks, summarize_indices
from .trace import layer_calls, trace


def site_calls(module, site, indices=None):
    """{block index: dotted name of the layer-depth call to edit after} for `site` in the blocks
    `indices` picks (None: every numbered block).

    Example:
        >>> site_calls(lm.backbone, "attn_out", [2])
        {2: 'layers.2.attn_out'}
    """
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, got {site!r}")
    blocks = numbered_blocks(module)
    picked = sorted(blocks) if indices is None else list(indices)
    missing = [i for i in picked if i not in blocks]
    if missing:
        raise ValueError(f"blocks {missing} are not blocks of this model: it has blocks "
                         f"{summarize_indices(blocks) or 'none'}")
    out = {}
    for i in picked:
        block = module.get_submodule(blocks[i])
        if isinstance(getattr(block, site, None), Site):
            out[i] = f"{blocks[i]}.{site}"
        elif site == "block_out" and (not isinstance(block, Block) or block.opaque):
            out[i] = blocks[i]  # one call at every depth: its output is the block's output
        else:
            have = [s for s in SITES if isinstance(getattr(block, s, None), Site)] or ["block_out"]
            raise ValueError(f"block {blocks[i]!r} ({type(block).__name__}) has no site {site!r}; "
                             f"its sites are {have}")
    return out


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
    one depth with other layer-depth calls.

    Example:
        >>> site_targets(lm.backbone, "block_out", [2])
        ('block', {2: ['layers.2']})
    """
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
