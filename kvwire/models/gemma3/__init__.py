"""Gemma 3 (text): config, backbone, converters."""
from ...layers import TiedHead
from ..registry import Family, register
from .backbone import Gemma3Backbone, Gemma3Block
from .config import Gemma3Config
from .convert import config_from_gguf, state_from_gguf, state_from_hf

FAMILY = register(Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    gguf_architecture="gemma3",
    config_cls=Gemma3Config,
    config_from_hf=Gemma3Config.from_hf,
    backbone=Gemma3Backbone,
    head=lambda b: TiedHead(b.embed_tokens, b.config.final_logit_softcapping),
    state_from_hf=state_from_hf,
    state_from_gguf=state_from_gguf,
    config_from_gguf=config_from_gguf,
))

__all__ = ["Gemma3Backbone", "Gemma3Block", "Gemma3Config", "FAMILY"]
