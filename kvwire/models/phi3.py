"""Phi-3: fused `qkv_proj` and `gate_up_proj` (split on load), partial rotary, longrope with
`original_max_position_embeddings`, an optional window on every layer."""
import re

from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields
from .decoder.convert import split_rows


def config_from_hf(d):
    d = dict(d)
    for key in ("rope_scaling", "rope_parameters"):  # transformers reads "su" and "yarn" as longrope here
        rope = d.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
            d[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}
    n, window = d.get("num_hidden_layers"), d.get("sliding_window")
    types = None if window is None or type(n) is not int else ("sliding_attention",) * n
    return decoder_config(d, "phi3", keys=("sliding_window",), defaults={"tie_word_embeddings": False},
                          layer_types=types)


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


_KEYS = ("attention.sliding_window", "rope.scaling.attn_factor")


def config_from_gguf(meta, vocab_size, source, file):
    fields, m = gguf_fields(meta, "phi3", vocab_size, source, file, keys=_KEYS,
                            attention_bias="blk.0.attn_qkv.bias" in file.tensor_names)
    if "rope_factors_long.weight" in file.tensor_names:  # longrope: its factors are tensors
        fields["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": file.tensor("rope_factors_long.weight").tolist(),
            "short_factor": file.tensor("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
            "attention_factor": m.float("rope.scaling.attn_factor", None)}
    window = m.int("attention.sliding_window", None, minimum=0) or None  # 0: none; else every layer slides
    types = None if window is None else ("sliding_attention",) * fields["num_hidden_layers"]
    return DecoderConfig(**fields, sliding_window=window, layer_types=types)


FAMILY = decoder_family("phi3", ("phi3",), config_from_hf, gguf_architecture="phi3", config_from_gguf=config_from_gguf,
                        hf_split=split, split=split)
