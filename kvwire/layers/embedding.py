"""Token embedding (optionally scaled, as Gemma does) and learned position embedding (GPT-2)."""
import torch
from torch import nn

from .base import Layer

SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class TokenEmbedding(Layer):
    """Token ids (B, T) -> vectors (B, T, D), multiplied by `scale` (Gemma: sqrt(D)).

    The scale is rounded to the weight dtype first, as Gemma's reference does. With
    `float32_for_float16`, float16 weights give float32 vectors: a model whose residual stream
    outgrows float16 (Gemma) keeps it float32, decided per call, so traced graphs follow `.half()`.

    `quantized`, when set (a GGUF load with `quantize="gguf"`: the file's own table, a `GGMLLinear`
    with `rows(ids)`), is what the rows are read from, dequantised one row at a time, instead of
    `weight`: the float table is then never read (671 MB in float32 for Gemma 3's 262k rows). Its
    values are the table's own (the float weight was dequantised from the same blocks). An edit of
    `weight` then reaches neither the lookups nor a quantised head's logits: edit a float load, or set
    `quantized = None` (and the head's) first.
    """

    def __init__(self, vocab_size, dim, scale=None, float32_for_float16=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.scale = scale
        self.float32_for_float16 = float32_for_float16
        self.quantized = None
        _init_normal(self.weight, 0.02)

    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, value):
        # rounded to each weight dtype once, as Python floats: a tensor made in forward would be a
        # constant of exported graphs that is not the model's (a kept step cannot be handed it)
        self._scale = value
        self._scales = {} if value is None else {
            dt: torch.tensor(value, dtype=dt, device="cpu").item() for dt in SCALE_DTYPES}

    def forward(self, token_ids):
        if self.quantized is not None:
            x = self.quantized.rows(token_ids).to(self.weight.dtype)
        else:
            x = nn.functional.embedding(token_ids, self.weight)
        if self.scale is not None:
            rounded = self._scales.get(self.weight.dtype)
            x = x * (rounded if rounded is not None else torch.tensor(self.scale, dtype=self.weight.dtype,
                                                                      device=x.device))
        if self.float32_for_float16 and x.dtype == torch.float16:
            x = x.float()
        return x


class PositionEmbedding(Layer):
    """Adds a learned position vector: x (B, T, D) -> x + weight[positions] (B, T, D).

    Plainly called, positions are 0..T-1; the cached graph passes each token's position.
    """

    uses_positions = True

    def __init__(self, max_positions, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions, dim))
        _init_normal(self.weight, 0.01)

    def forward(self, x):
        return x + self.weight[: x.shape[1]]

    def forward_cached(self, x, *, positions):
        return x + nn.functional.embedding(positions, self.weight)


def _init_normal(weight, std):
    # On the meta device (loading a checkpoint) there is nothing to initialise.
    if not weight.is_meta:
        nn.init.normal_(weight, std=std)
