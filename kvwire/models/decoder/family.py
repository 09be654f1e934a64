"""`decoder_family`: register a family of the shared decoder from its mapping and converter rules."""
from ..registry import Family, register
from . import convert
from .backbone import DecoderBackbone, decoder_head
from .config import DecoderConfig


def decoder_family(name, hf_model_types, config_from_hf, *, gguf_architecture=None, config_from_gguf=None,
                   hf_renames=convert.PRE_NORM_RENAMES, hf_split=None, **gguf_rules):
    """Register family `name` on `DecoderBackbone`.

    Args:
        hf_model_types: HF `model_type`s it loads. config_from_hf(dict) -> DecoderConfig.
        gguf_architecture / config_from_gguf(meta, vocab_size, source, file) -> DecoderConfig:
            its GGUF files, if llama.cpp writes any. hf_renames / hf_split: HF name rules
            (`convert.state_from_hf`); gguf_rules: `convert.state_from_gguf`'s keywords.
    """
    def state_from_hf(state, config):
        return convert.state_from_hf(state, config, hf_renames, hf_split)

    def state_from_gguf(tensors, config):
        return convert.state_from_gguf(tensors, gguf_architecture, config, **gguf_rules)

    return register(Family(
        name=name, hf_model_types=tuple(hf_model_types), gguf_architecture=gguf_architecture,
        config_cls=DecoderConfig, config_from_hf=config_from_hf, backbone=DecoderBackbone, head=decoder_head,
        state_from_hf=state_from_hf, state_from_gguf=state_from_gguf if gguf_architecture else _no_gguf(name),
        config_from_gguf=config_from_gguf or _no_gguf(name)))


def _no_gguf(name):
    def refuse(*args, **kwargs):
        raise ValueError(f"kvwire reads no GGUF files of the {name} family")
    return refuse
