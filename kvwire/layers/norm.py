"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm, scaled by its weight (Llama) or by
(1 + weight) (Gemma)."""
import torch
from torch import nn

from ..kernels import cpu
from ..kernels.native import fused
from .base import Layer


class LayerNorm(Layer):
    """`nn.LayerNorm` as a kvwire layer. x (..., D) -> (..., D)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(Layer):
    """RMSNorm computed in float32: x (..., D) -> (..., D), scaled by `weight` (Llama, Qwen, OLMo)
    or, with `offset` (Gemma), by (1 + weight).

    With `offset` the checkpoint stores `weight` with the 1 removed (zeros means identity), as
    transformers does; without it, ones mean identity. Eager calls run in one pass where
    `cpu.fused()` is "kvwire" (`native.fused`: x and weight of one dtype, D a multiple of 16).

    Example:
        >>> RMSNorm(8, 1e-6, offset=False)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, dim, eps=1e-6, offset=True):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if not (torch.compiler.is_compiling() or torch.jit.is_tracing()) and cpu.fused() == "kvwire" \
                and fused.applies_rms_norm(x, self.weight):  # one pass (`native.fused`); compilers fuse the ops below
            return fused.rms_norm(x, self.weight, self.eps, self.offset)
        h = nn.functional.rms_norm(as_float32(x), x.shape[-1:], None, self.eps)
        w = as_float32(self.weight)
        h = torch.addcmul(h, h, w) if self.offset else h * w  # h * (1 + w) in one op
        # the weights' dtype: a float32 residual stream feeds float16 layers (Gemma's float16 path)
        dtype = self.weight.dtype
        return h if h.dtype == dtype else h.to(dtype)


def as_float32(t):
    """t in float32; skips the call when it already is (a decode step makes hundreds of them)."""
    return t if t.dtype == torch.float32 else t.float()
