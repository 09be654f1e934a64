"""`kw.quantize`: swap a model's linear maps for weight-only quantised ones, in place."""
from .linear import SCHEMES, QuantizedLinear, check_shape
from .targets import linears, quantizable_head


def quantize(lm, scheme="int4", group_size=32, head=True, layers=True):
    """Quantise the weights of every `nn.Linear` in `lm.backbone` (and the head).

    Activations, norms, embeddings, attention and the KV cache keep their dtype; only the matmul
    weights shrink (decode streams 4 or 8 bits a weight instead of 16 or 32). The tied embedding
    keeps its float table for token lookups; the head gets a quantised copy for the logits.
    In place: models made from `lm` with `edit`/`steer` share its layers and change too.

    Args:
        lm: a `CausalLM`. scheme: "int8" (one scale per output row) or "int4" (scale and zero per
            `group_size` inputs) on PyTorch's kernels, or a ggml format ("q8_0", "q5_0", "q4_0",
            "q4_k", "q6_k", ...) quantised and run by ggml (`kvwire[ggml]`; `quantize_ggml`).
            head: quantise the logits head (the largest matrix). layers: quantise the backbone's
            linear maps; `layers=False` re-quantises only the head (e.g. a smaller head for a
            `quantize="gguf"` model, whose Q8_0 head is most of a decode step's bytes).

    Returns `lm`.

    Example:
        >>> lm = kw.quantize(kw.load("gemma3-270m", dtype="bfloat16"), "int4")
        >>> lm.generate("The capital of France is", max_new_tokens=8)
    """
    if scheme not in SCHEMES:
        from .ggml import qtype_of, quantize_ggml
        try:
            qtype_of(scheme)
        except ValueError:
            raise ValueError(f"unknown quantisation scheme {scheme!r}; expected one of {SCHEMES} or a ggml "
                             f"type such as 'q8_0' or 'q4_k'") from None
        return quantize_ggml(lm, scheme, head, layers)
    swaps = linears(lm) if layers else []
    target = quantizable_head(lm) if head else None
    # every shape is checked, then every weight quantised, before the model changes: a failure
    # leaves it as it was (at the price of holding every quantised copy and the float weights at
    # once: about 1.25x the float model for int4, 1.5x for int8, instead of one layer at a time)
    paths = {child: path for path, child in lm.backbone.named_modules()}
    for _, _, child in swaps:
        check_shape(child.weight.shape, scheme, group_size, name=f"layer {paths[child]!r}")
    if head:
        check_shape(lm.head.weight.shape, scheme, group_size, name="the head")
    new = [QuantizedLinear.from_linear(child, scheme, group_size) for _, _, child in swaps]
    head_weights = QuantizedLinear(lm.head.weight, None, scheme, group_size) if head else None
    for (parent, name, _), module in zip(swaps, new):
        setattr(parent, name, module)
    if head:
        target.quantized = head_weights
    lm.reset_caches()
    return lm
