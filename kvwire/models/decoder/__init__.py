"""The shared decoder: one block and backbone for every Llama-like family; families are data."""
from .backbone import DecoderBackbone, DecoderBlock, decoder_head
from .config import DecoderConfig, sliding_layer_types
from .convert import config_from_gguf as gguf_fields
from .convert import gguf_biases
from .family import decoder_family
from .hf import decoder_config

__all__ = ["DecoderBackbone", "DecoderBlock", "DecoderConfig", "decoder_config", "decoder_family", "decoder_head",
           "gguf_biases", "gguf_fields", "sliding_layer_types"]
