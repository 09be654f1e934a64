"""Phi-3: fused `qkv_proj` and `gate_up_proj` (split on load), partial rotary, longrope with
`original_max_position_embeddings`, an optional window on every layer."""
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
    c, (prefix, _, rest) = config, key.partition(".self_attn.") if ".self_attn." in key else key.rpartition(".mlp.")
    kind = key.rsplit(".", 1)[1]
    if rest.startswith("qkv_proj.") or key.endswith((".attn_qkv.weight", ".attn_qkv.bias")):
        prefix = prefix.removesuffix(".attn_qkv." + kind)
        kv = c.num_key_value_heads * c.head_dim
        return split_rows(key, value, [f"{prefix}.self_attn.{p}_proj.{kind}" for p in "qkv"],
                          (c.num_attention_heads * c.head_dim, kv, kv))
    if rest == "gate_up_proj.weight" or (rest == "up_proj.weight" and value.shape[0] == 2 * c.intermediate_size):
        return split_rows(key, value, [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up")],
                          (c.intermediate_size, c.intermediate_size))
    return {key: value}


def config_from_gguf(meta, vocab_size, source, tensor_names):
    if any(n.startswith("rope_factors_") for n in tensor_names):
        raise ValueError(f"{source}: longrope factors (rope_factors_long/short tensors) are not supported in "
                         f"GGUF files yet; load the Hugging Face folder instead")
    fields, m = gguf_fields(meta, "phi3", vocab_size, source, tensor_names, keys=("attention.sliding_window",),
                            attention_bias="blk.0.attn_qkv.bias" in tensor_names)
    window = m.int("attention.sliding_window", None)  # as config.json's: every layer slides
    types = None if window is None else ("sliding_attention",) * fields["num_hidden_layers"]
    return DecoderConfig(**fields, sliding_window=window, layer_types=types)


FAMILY = decoder_family("phi3", ("phi3",), config_from_hf, gguf_architecture="phi3", config_from_gguf=config_from_gguf,
                        hf_split=split, split=split)
