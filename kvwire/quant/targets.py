"""The maps a quantiser swaps: every `nn.Linear` of a backbone, and a head that can hold a quantised copy.

Shared by `quant.apply` (int8 / int4) and `quant.ggml.apply` (ggml blocks); `quant.apply` imports the
ggml side, never the reverse.
"""
from torch import nn


def linears(lm):
    """(parent, name, child) for every `nn.Linear` in `lm.backbone`: the maps a quantiser swaps."""
    return [(parent, name, child) for parent in lm.backbone.modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def quantizable_head(lm):
    """`lm.head` if it can hold a quantised copy of its weight (`head.quantized`), else a ValueError."""
    if not hasattr(lm.head, "quantized"):
        raise ValueError(f"head {type(lm.head).__name__} cannot be quantised; pass head=False")
    return lm.head
