"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm with a (1 + weight) scale (Gemma)."""
import torch
from torch import nn

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
    """Gemma's RMSNorm: computed in float32, scaled by (1 + weight). x (..., D) -> (..., D).

    The checkpoint stores `weight` with the 1 removed (zeros means identity), as transformers does.
    """

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        h = nn.functional.rms_norm(as_float32(x), x.shape[-1:], None, self.eps)
        h = torch.addcmul(h, h, as_float32(self.weight))  # h * (1 + w) in one op
        # the weights' dtype: a float32 residual stream feeds float16 layers (Gemma's float16 path)
        dtype = self.weight.dtype
        return h if h.dtype == dtype else h.to(dtype)


def as_float32(t):
    """t in float32; skips the call when it already is (a decode step makes hundreds of them)."""
    return t if t.dtype == torch.float32 else t.float()
