"""A `torch.compile`d decode step: the cached graph and the head for one token per row.

Decode at batch 1 runs ~2,700 small ops a token; eager PyTorch pays ~5 us of dispatch for each,
more than the weights cost to stream once they are 4-8 bits. Compiled, Inductor fuses the norms,
rotary, masks and softmax into a few C++ kernels, and the matmuls stay library calls. Shapes are
static (one compile per batch size and cache length), so cache lengths are rounded up to
`bucket` slots and calls with different `max_length` reuse one compiled step.
"""
import torch


class CompiledDecode:
    """decode(ids (B, 1), positions (B, 1), cache_index (), mask (B, L), cache, extra) ->
    (logits (B, V), cache): the same values as the eager cached graph + head, compiled.

    Example:
        >>> lm = kw.load("gemma3-270m", quantize="gguf").compile()
        >>> lm.generate("Once upon a time", max_new_tokens=64)   # first call compiles (~1 min)
    """

    def __init__(self, cached, head, bucket=256, **options):
        if not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"bucket must be a positive int (cache slots to round lengths up to), got {bucket!r}")
        self.bucket = bucket
        graph = cached.graph_module

        def step(token_ids, positions, cache_index, attention_mask, cache, *extra):
            hidden, cache = graph(token_ids, positions, cache_index, attention_mask, cache, *extra)
            return head(hidden[:, -1]), cache

        self.step = torch.compile(step, dynamic=False, **options)

    def length(self, max_length, limit=None):
        """max_length rounded up to a whole number of buckets (not past `limit` when given)."""
        rounded = -(-max_length // self.bucket) * self.bucket
        return rounded if limit is None or max_length > limit else min(rounded, limit)

    def __call__(self, token_ids, positions, cache_index, attention_mask, cache, extra):
        return self.step(token_ids, positions, cache_index, attention_mask, cache, *extra)
