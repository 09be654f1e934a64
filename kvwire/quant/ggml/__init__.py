"""GGUF block formats on ggml's CPU kernels (from llama-cpp-python): `GGMLLinear`,
`use_gguf_blocks` (a GGUF file's own weights) and `quantize_ggml` (any model)."""
from ...kernels.ggml.lib import GGMLUnavailable
from .apply import quantize_ggml, use_gguf_blocks
from .linear import GGMLLinear, qtype_of

__all__ = ["GGMLLinear", "GGMLUnavailable", "qtype_of", "quantize_ggml", "use_gguf_blocks"]
