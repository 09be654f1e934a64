"""Weight-only quantisation for fast CPU decoding: int8 / int4 on PyTorch's kernels (`linear`), GGUF
block formats on ggml's kernels (`ggml`)."""
from .apply import quantize
from .linear import SCHEMES, QuantizedLinear

__all__ = ["SCHEMES", "QuantizedLinear", "quantize"]
