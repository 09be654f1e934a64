"""Phi-3: fused `qkv_proj` and `gate_up_proj` (split on load), partial rotary, longrope with
`original_max_position_embeddings`, an optional window on every layer."""
import re

from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields, sliding_layer_types
from .decoder.convert import split_rows


def config_from_hf(d):
    # transformers' Phi-3 reads "su" and "yarn" as longrope
    return decoder_config(d, "phi3", keys=("sliding_window",), defaults={"tie_word_embeddings": False}, sliding={},
                          rope_aliases={"su": "longrope", "yarn": "longrope"})


def split(key, value, config):
    """Fused rows: qkv_proj (GGUF attn_qkv) -> q, k, v; gate_up_proj (GGUF: an ffn_up twice the
    MLP width) -> gate, up."""
    c = config
    m = re.fullmatch(r"(layers\.\d+)\.(self_attn\.qkv_proj|attn_qkv|mlp\.gate_up_proj|mlp\.up_proj)\.(weight|bias)", key)
    if m is None:
        return {key: value}
    layer, part, kind = m.groups()
    if part in ("self_attn.qkv_proj", "attn_qkv"):
        kv = c.num_key_value_heads * c.head_dim
        return split_rows(key, value, [f"{layer}.self_attn.{p}_proj.{kind}" for p in "qkv"],
                          (c.num_attention_heads * c.head_dim, kv, kv))
    if part == "mlp.gate_up_proj" or value.shape[0] == 2 * c.intermediate_size:
        return split_rows(key, value, [f"{layer}.mlp.{p}_proj.{kind}" for p in ("gate", "up")],
                          (c.intermediate_size, c.intermediate_size))
    return {key: value}


_KEYS = ("attention.sliding_window", "rope.scaling.attn_factor")  # attn_factor: longrope's (gguf_fields reads it)


def config_from_gguf(meta, vocab_size, source, file):
    fields, m = gguf_fields(meta, "phi3", vocab_size, source, file, keys=_KEYS,
                            attention_bias="blk.0.attn_qkv.bias" in file.tensor_names)
    window = m.int("attention.sliding_window", None, minimum=0) or None  # 0: none; else every layer slides
    types = None if window is None else sliding_layer_types(fields["num_hidden_layers"])
    return DecoderConfig(**fields, sliding_window=window, layer_types=types)


FAMILY = decoder_family("phi3", ("phi3",), config_from_hf, gguf_architecture="phi3", config_from_gguf=config_from_gguf,
                        hf_split=split, split=split)
