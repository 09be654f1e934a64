"""Weight-only quantisation (int8, int4) for fast CPU decoding."""
from .apply import quantize
from .linear import SCHEMES, QuantizedLinear

__all__ = ["SCHEMES", "QuantizedLinear", "quantize"]
