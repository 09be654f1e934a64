"""Gemma (1): Llama's layout with Gemma's (1 + w) norms, sqrt(hidden) embedding scale and a tied
head. Its legacy `hidden_act="gelu"` means the tanh approximation, as transformers reads it."""
import math

from .decoder import decoder_config, decoder_family


def config_from_hf(d):
    d = dict(d)
    if d.get("hidden_act") == "gelu":
        d["hidden_act"] = "gelu_pytorch_tanh"
    if d.get("hidden_activation") in (None, d.get("hidden_act", "gelu_pytorch_tanh")):
        d.pop("hidden_activation", None)  # v4's duplicate of hidden_act
    hidden = d.get("hidden_size", 3072)
    return decoder_config(d, "gemma", keys=("attention_bias",), defaults={"hidden_act": "gelu_pytorch_tanh"},
                          norm_offset=True, embedding_scale=math.sqrt(hidden) if type(hidden) is int else None,
                          float32_residual=True)


FAMILY = decoder_family("gemma", ("gemma",), config_from_hf)
