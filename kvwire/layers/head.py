"""The language-model head: logits from the tied token embedding or an untied output matrix."""
import torch
from torch import nn

from ..kernels.products import linear
from .base import Layer
from .linear import WeightPack


class OutputWeight(Layer):
    """The untied output matrix (V, D) of a model whose head is not its embedding (Llama 3 8B,
    Phi-3): a backbone submodule named `lm_head`, as in the checkpoint, that the backbone's forward
    never calls; `TiedHead(backbone.lm_head)` reads it."""

    def __init__(self, vocab_size, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))


class TiedHead(Layer):
    """Logits from hidden states with the token embedding's weight, or an `OutputWeight`'s:
    (B, T, D) -> (B, T, V), divided by `divisor` (Granite's logits_scaling) and optionally
    soft-capped as tanh(logits / c) * c. Shares the owner's weight; a float32 batch-1 decode step
    reads an MKL-packed copy of it where `cpu.f32_gemv()` is "transposed", a float32 step of 2-64
    rows a oneDNN-packed one where it is "linear", bfloat16 products a oneDNN-packed one where the
    CPU has bf16 units (`WeightPack`: the head is most of a decode step's bytes; compiled float32
    steps too), made after 64 products and freed by `lm.reset_caches()`. One row where `cpu.f32_row()`
    is "kvwire" (float32, or bfloat16 eager) reads the weight itself on kvwire's GEMV instead.

    Example:
        >>> head = TiedHead(backbone.embed_tokens)
        >>> head(torch.randn(1, 3, 640)).shape
        torch.Size([1, 3, 262144])
    """

    def __init__(self, embedding, softcap=None, divisor=None):
        super().__init__()
        self.weight = embedding.weight
        self.softcap, self.divisor = softcap, divisor
        # set by `kw.quantize`: a quantised copy of the weight that computes the logits, while the
        # embedding keeps the float table for its lookups
        self.quantized = None
        self.pack = WeightPack()

    def forward(self, hidden):
        if self.quantized is not None:
            logits = self.quantized(hidden)
        else:
            logits = self.pack(hidden, self.weight)
            logits = linear(hidden, self.weight) if logits is None else logits
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = (logits / self.softcap).tanh() * self.softcap
        return logits
