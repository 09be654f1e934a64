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

One more site lies inside the attention layer, which is one call of the graph (it owns a cache):
- `attn_heads`: the heads' outputs side by side, (B, T, num_heads * head_dim), as the output
  projection reads them (head h is columns [h * head_dim, (h + 1) * head_dim)); what is put there
  runs inside the attention call (`kvwire.layers.inner`).
A block made of another library's modules (the generic path's transformers layers) holds all its
sites but `block_out` inside its one call, in the same way.
"""
from .base import Layer

SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "block_out")
ALL_SITES = SITES + ("attn_heads",)  # and the per-head site, inside attention


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
