"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Gemma checkpoints use)."""
import torch
from torch import nn


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

    def forward(self, x, positions):
        """x (B, H, T, hd), positions (B, T) int -> (B, H, T, hd)."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, hd/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hd)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
