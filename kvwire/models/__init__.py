"""Model families. Importing this package registers every family."""
from . import gemma3, gpt2
from .registry import FAMILIES, by_gguf_architecture, by_hf_model_type

__all__ = ["FAMILIES", "by_gguf_architecture", "by_hf_model_type", "gemma3", "gpt2"]
