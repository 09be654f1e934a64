"""Directions at the per-head site, "attn_heads": the heads' outputs side by side, (B, T, H * d),
as the attention's output projection reads them (head h is columns [h * d, (h + 1) * d))."""
import torch

from ..graph.sites import inner_calls


def head_basis(lm, heads):
    """{block: (len(hs) * d, H * d) float32} one-hot rows spanning the columns of the given heads at
    "attn_heads", for `lm.ablate` (zero the heads) or `lm.clamp`.

    Args:
        heads: {block index: [head indices]}.

    Example:
        >>> knocked_out = lm.ablate(kw.steer.head_basis(lm, {3: [0, 5]}), site="attn_heads")
    """
    if not isinstance(heads, dict) or not heads:
        raise TypeError(f"heads must be a non-empty {{block: [head indices]}} dict, got {heads!r}")
    calls = inner_calls(lm.backbone, "attn_heads", list(heads))
    missing = [i for i in heads if i not in calls]
    if missing:
        raise ValueError(f"blocks {missing} have no per-head site 'attn_heads' in this model")
    out = {}
    for i, picked in heads.items():
        leaf = lm.backbone.get_submodule(calls[i])
        width, size = leaf.site_width("attn_heads"), leaf.head_size
        count = width // size
        picked = [picked] if isinstance(picked, int) else list(picked)
        bad = [h for h in picked if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < count]
        if bad or not picked or len(set(picked)) != len(picked):
            raise ValueError(f"block {i}: heads {picked} must be distinct indices in [0, {count}) "
                             f"(the block has {count} heads of size {size})")
        rows = torch.zeros(len(picked) * size, width)
        for k, h in enumerate(picked):
            rows[k * size:(k + 1) * size, h * size:(h + 1) * size] = torch.eye(size)
        out[i] = rows
    return out
