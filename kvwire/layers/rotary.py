"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Gemma checkpoints use)."""
import torch
from torch import nn

from .shared import shared


class Rotary(nn.Module):
    """Rotates query/key heads by their positions.

    Args:
        head_dim: size of one head; base: the rope theta (Gemma 3: 10k sliding, 1M full);
        scaling_factor: linear position interpolation factor (1.0 = none).

    Example:
        >>> r = Rotary(8, 10_000.0)
        >>> r(torch.randn(1, 2, 5, 8), torch.arange(5)[None]).shape
        torch.Size([1, 2, 5, 8])
    """

    def __init__(self, head_dim, base, scaling_factor=1.0):
        super().__init__()
        self.head_dim, self.base, self.scaling_factor = head_dim, base, scaling_factor
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self):
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
        return 1.0 / (self.base**exponents) / self.scaling_factor

    def reset_buffers(self):
        """Recompute the frequencies (after the module was built on the meta device)."""
        self.inv_freq = self._inv_freq()

    def tables(self, positions, dtype=torch.float32):
        """cos and signed sin for positions (B, T): each (B, 1, T, head_dim); the sin's first half
        is negated (the rotate-half sign folded in). Rotaries with equal settings share them
        within one cached-graph call."""
        settings = (Rotary, self.head_dim, self.base, self.scaling_factor)
        return shared(self._tables, positions, dtype, key=settings)

    def _tables(self, positions, dtype):
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, hd/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hd)
        sin = freqs.sin()[:, None]
        return angles.cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    @staticmethod
    def rotate(x, cos, signed_sin):
        """x (B, H, T, hd) rotated by the tables of `tables`: x cos + [x2, x1] signed_sin, which
        is x cos + [-x2, x1] sin in 5 ops instead of 7 (a decode step rotates 36 tensors)."""
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), signed_sin)

    def forward(self, x, positions):
        """x (B, H, T, hd), positions (B, T) int -> (B, H, T, hd)."""
        return self.rotate(x, *self.tables(positions, x.dtype))
