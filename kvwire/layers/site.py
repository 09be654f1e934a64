"""`Site`: a named point inside a block where the residual stream, or what a sublayer writes to
it, can be read (`kw.tap`) or edited (`kw.insert_after`, steering operations). An identity layer.

The sites of a block, in order (x is the residual stream, `attn`/`mlp` the sublayers with the norms
the family puts around them):

    x ──resid_pre──┬──────────────────────(+)──resid_mid──┬───────────────────(+)──block_out──▶
                   └─ attn ─ [post-norm] ─ attn_out ─┘     └─ mlp ─ [post-norm] ─ mlp_out ─┘

- `resid_pre`: the block's input; `block_out`: its output (what llama.cpp's control vectors edit);
- `attn_out`, `mlp_out`: what attention and the MLP add to the stream (after a post-sublayer norm
  where the family has sandwich norms, after a residual multiplier where it has one);
- `resid_mid`: the stream between the two.
They exist only as names: the cache pass drops the bare ones, so a site costs nothing in the cached
graph until something is inserted after it.
"""
from .base import Layer

SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "block_out")


class Site(Layer):
    """Identity: `x (B, T, D) -> x`, named by its place in the block (see `SITES`).

    Example:
        >>> kw.tap(lm.backbone, "layers.3.attn_out", depth="layer")
    """

    def forward(self, x):
        return x


def add_sites(block):
    """Give `block` one `Site` child per name in `SITES` (called in a block's `__init__`)."""
    for name in SITES:
        block.add_module(name, Site())
