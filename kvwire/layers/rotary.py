"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Gemma/Phi-3 checkpoints use),
with transformers' scaling types (the maths lives in `rope_scaling`)."""
import math

import torch
from torch import nn

from .rope_scaling import ROPE_TYPES, call_inv_freq, check_rope_scaling, resolve_rope_scaling, rope_tables
from .shared import shared


class Rotary(nn.Module):
    """Rotates query/key heads by their positions.

    Args:
        head_dim: size of one head. base: the rope theta (Gemma 3: 10k sliding, 1M full).
        scaling: None; a number, kept for older callers: a linear factor (1.0 = none); or
            transformers' scaling dict: {"rope_type": "default" | "linear" | "dynamic" | "llama3" |
            "yarn" | "longrope", that type's parameters} (see `rope_scaling.check_rope_scaling`).
        rotary_dim: leading dims of each head that rotate (Phi-3's partial rotary:
            int(head_dim * partial_rotary_factor)); the rest pass through unchanged. Default head_dim.
        max_position_embeddings: the config's. "dynamic" rescales past it; llama3, yarn and longrope
            default original_max_position_embeddings to it, longrope its factor to the ratio of the two.

    Yarn's and longrope's attention factor is folded into cos and sin, as transformers does.

    Length-dependent types: "dynamic" (NTK) and "longrope" depend on the call's length, as in
    transformers' `dynamic_rope_update`: seq_len = max(positions) + 1 over the whole call. Dynamic
    grows its base once seq_len > max_position_embeddings; longrope uses long_factor once seq_len >
    original_max_position_embeddings, else short_factor. Here that is a pure function of the call's
    positions (tensor ops, nothing kept between calls), so an uncached forward of T tokens matches
    transformers. Beyond the original context a cached decode then differs from an uncached pass
    exactly as transformers' own cache does: each key stays rotated by the tables of the call that
    wrote it. (transformers' dynamic also keeps grown tables for later, shorter calls until one is
    below max_position_embeddings; nothing carries over here.)

    Shapes: tables(positions (B, T)) -> cos, signed sin, each (B, 1, T, rotary_dim);
    forward(x (B, H, T, head_dim), positions (B, T)) -> (B, H, T, head_dim).

    Example:
        >>> r = Rotary(8, 10_000.0, {"rope_type": "yarn", "factor": 4.0}, rotary_dim=4,
        ...            max_position_embeddings=64)
        >>> r(torch.randn(1, 2, 5, 8), torch.arange(5)[None]).shape
        torch.Size([1, 2, 5, 8])
    """

    def __init__(self, head_dim, base, scaling=None, *, rotary_dim=None, max_position_embeddings=None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not (_is_int(head_dim) and _is_int(rotary_dim) and 0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={rotary_dim!r} with head_dim={head_dim!r}; expected an even "
                             f"integer in (0, head_dim]")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (0 < base < math.inf):
            raise ValueError(f"rope base (theta) {base!r}; expected a finite number > 0")
        mpe = max_position_embeddings
        if mpe is not None and not (_is_int(mpe) and mpe > 0):
            raise ValueError(f"max_position_embeddings={max_position_embeddings!r}; expected an integer > 0 or None")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.max_position_embeddings = max_position_embeddings
        self.scaling = check_rope_scaling(scaling, rotary_dim=rotary_dim)  # normalised, or None
        self.params = resolve_rope_scaling(self.scaling, rotary_dim, max_position_embeddings)
        self.attention_factor = self.params["attention_factor"]
        self.depends_on_length = ROPE_TYPES[self.params["rope_type"]].per_call is not None  # dynamic, longrope
        scaling_key = None if self.scaling is None else tuple(sorted(self.scaling.items()))  # hashable
        self._settings = (Rotary, head_dim, rotary_dim, base, max_position_embeddings, scaling_key)
        self._names = []
        for name, table in rope_tables(self.params, base, rotary_dim).items():
            self.register_buffer(name, table, persistent=False)
            self._names.append(name)

    def _apply(self, fn, recurse=True):
        # `.to(torch.bfloat16)` would round the frequencies, and with them every angle: a cast model
        # would rotate unlike one loaded in that dtype, whose tables are float32
        super()._apply(fn, recurse)
        buffers = [getattr(self, name) for name in self._names]
        if any(b.dtype in (torch.float16, torch.bfloat16) for b in buffers):
            self.reset_buffers(buffers[0].device)
        return self

    def reset_buffers(self, device=None):
        """Recompute the frequencies in float32 on `device` (None: the CPU), after the module was built
        on the meta device or cast to a lower precision."""
        for name, table in rope_tables(self.params, self.base, self.rotary_dim).items():
            setattr(self, name, table if device is None else table.to(device))

    def tables(self, positions, dtype=torch.float32):
        """cos and signed sin for positions (B, T): each (B, 1, T, rotary_dim); the sin's first half
        is negated (the rotate-half sign folded in). Rotaries with equal settings share them
        within one cached-graph call."""
        return shared(self._tables, positions, dtype, key=self._settings)

    def _tables(self, positions, dtype):
        inv_freq = self.inv_freq
        if self.depends_on_length:  # transformers' dynamic_rope_update: the call's max position + 1
            tables = {name: getattr(self, name) for name in self._names}
            inv_freq = call_inv_freq(self.params, tables, positions.max() + 1, self.base, self.rotary_dim)
        freqs = positions[..., None].float() * inv_freq  # (B, T, rd/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, rd)
        cos, sin = angles.cos(), freqs.sin()[:, None]
        if self.attention_factor != 1.0:  # yarn/longrope scale cos and sin (transformers' attention_scaling)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def rotate(self, x, cos, signed_sin):
        """x (B, H, T, head_dim) rotated by the tables of `tables`: x cos + [x2, x1] signed_sin on the
        first rotary_dim dims, which is x cos + [-x2, x1] sin in 5 ops instead of 7 (a decode step
        rotates 36 tensors); the other dims pass through (Phi-3's apply_rotary_pos_emb)."""
        rd, half = self.rotary_dim, self.rotary_dim // 2
        if rd == self.head_dim:
            return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), signed_sin)
        x_rot = x[..., :rd]
        rotated = torch.addcmul(x_rot * cos, torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1), signed_sin)
        return torch.cat((rotated, x[..., rd:]), dim=-1)

    def forward(self, x, positions):
        """x (B, H, T, head_dim), positions (B, T) int -> (B, H, T, head_dim)."""
        return self.rotate(x, *self.tables(positions, x.dtype))


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)
