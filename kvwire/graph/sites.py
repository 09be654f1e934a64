"""Where a steering operation goes: the layer-depth call of a named site in numbered blocks.

Blocks of the shared decoder and GPT-2 have the sites of `kvwire.layers.site.SITES` as `Site`
children; a block without them (one made of another library's modules, called as one layer) has
its output, `block_out`, only.
"""
from ..layers.base import Block
from ..layers.site import SITES, Site
from .edit import numbered_blocks, summarize_indices
from .trace import layer_calls


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


def chain_end(gm, call):
    """The last layer with runtime inputs chained after `call` in the layer-depth graph `gm` (or
    `call`): something new put at a site acts after what was put there before, in order."""
    node = next(n for n in layer_calls(gm) if n.target == call)
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op != "call_module" or not getattr(gm.get_submodule(user.target), "runtime_inputs", None) \
                or user.args[:1] != (node,):
            break
        node = user
    return node.target
