"""Model families. Importing this package registers every family."""
from . import gemma, gemma2, gemma3, gpt2, granite, llama, mistral, olmo2, phi3, qwen2, qwen3
from .registry import FAMILIES, by_gguf_architecture, by_hf_model_type

__all__ = ["FAMILIES", "by_gguf_architecture", "by_hf_model_type"]
