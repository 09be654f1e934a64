"""Gemma 3 (text): its config and converters, on the shared decoder."""
from ..decoder import DecoderBackbone, decoder_head
from ..registry import Family, register
from .config import Gemma3Config
from .convert import config_from_gguf, state_from_gguf, state_from_hf

FAMILY = register(Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    gguf_architecture="gemma3",
    config_cls=Gemma3Config,
    config_from_hf=Gemma3Config.from_hf,
    backbone=lambda config: DecoderBackbone(config.decoder()),
    head=decoder_head,
    state_from_hf=state_from_hf,
    state_from_gguf=state_from_gguf,
    config_from_gguf=config_from_gguf,
))

__all__ = ["Gemma3Config", "FAMILY"]
