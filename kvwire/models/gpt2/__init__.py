"""GPT-2: config, backbone, converters."""
from ...layers import TiedHead
from ..registry import Family, register
from .backbone import GPT2Backbone, GPT2Block
from .config import GPT2Config
from .convert import config_from_gguf, state_from_gguf, state_from_hf

FAMILY = register(Family(
    name="gpt2",
    hf_model_types=("gpt2",),
    gguf_architecture="gpt2",
    config_cls=GPT2Config,
    config_from_hf=GPT2Config.from_hf,
    backbone=GPT2Backbone,
    head=lambda b: TiedHead(b.wte),
    state_from_hf=state_from_hf,
    state_from_gguf=state_from_gguf,
    config_from_gguf=config_from_gguf,
))

__all__ = ["GPT2Backbone", "GPT2Block", "GPT2Config", "FAMILY"]
