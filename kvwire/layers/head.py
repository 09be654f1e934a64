"""The language-model head: logits from the tied token embedding."""
from .base import Layer
from .linear import OneRowPack, linear


class TiedHead(Layer):
    """Logits from hidden states with the (tied) token embedding: (B, T, D) -> (B, T, V),
    optionally soft-capped as tanh(logits / c) * c. Shares the embedding's weight; a float32
    batch-1 decode step reads an MKL-packed copy of it (`OneRowPack`: the head is most of a decode
    step's bytes), made on first use and freed by `lm.reset_caches()`.

    Example:
        >>> head = TiedHead(backbone.embed_tokens)
        >>> head(torch.randn(1, 3, 640)).shape
        torch.Size([1, 3, 262144])
    """

    def __init__(self, embedding, softcap=None):
        super().__init__()
        self.weight = embedding.weight
        self.softcap = softcap
        # set by `kw.quantize`: a quantised copy of the weight that computes the logits, while the
        # embedding keeps the float table for its lookups
        self.quantized = None
        self.pack = OneRowPack()

    def forward(self, hidden):
        if self.quantized is not None:
            logits = self.quantized(hidden)
        else:
            logits = self.pack(hidden, self.weight)
            logits = linear(hidden, self.weight) if logits is None else logits
        if self.softcap is not None:
            logits = (logits / self.softcap).tanh() * self.softcap
        return logits
