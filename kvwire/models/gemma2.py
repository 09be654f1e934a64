"""Gemma 2: Gemma's norms in the sandwich placement, attention and final logit soft-capping,
q.k scaled by query_pre_attn_scalar, sliding windows on alternate layers (`layer_types`)."""
import math

from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields, sliding_layer_types

# Gemma 2 and 3: (1 + w) norms around both sublayers; the residual stream outgrows float16
GEMMA = dict(norm_placement="sandwich", norm_offset=True, float32_residual=True)


def config_from_hf(d):
    d = dict(d)
    scalar = d.pop("query_pre_attn_scalar", 256)
    return decoder_config(
        d, "gemma2", keys=("attention_bias", "sliding_window", "layer_types", "attn_logit_softcapping",
                           "final_logit_softcapping"),
        renames={"hidden_activation": "hidden_act"},
        defaults={"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                  "final_logit_softcapping": 30.0},
        sliding={"full_every": 2}, **scales(d, scalar, "gemma2"), **GEMMA)


def scales(d, scalar, family):
    """Gemma's multipliers: q.k by query_pre_attn_scalar ** -0.5, embeddings by sqrt(hidden_size)."""
    if type(scalar) not in (int, float) or not scalar > 0:
        raise ValueError(f"{family} config: query_pre_attn_scalar={scalar!r}; expected a positive number")
    hidden = d.get("hidden_size")  # a bad or missing size is DecoderConfig's to name
    return dict(query_scale=scalar**-0.5, embedding_scale=math.sqrt(hidden) if type(hidden) is int else None)


def gguf_scales(fields, big_layers):
    """`scales` for a GGUF file, which has no query_pre_attn_scalar: like llama.cpp, head_dim, but
    hidden_size / heads for the 27B model (`big_layers` blocks: Gemma 2's 46, Gemma 3's 62)."""
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    scalar = hidden // heads if fields["num_hidden_layers"] == big_layers else fields["head_dim"]
    return dict(query_scale=scalar**-0.5, embedding_scale=math.sqrt(hidden))


_KEYS = ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


def config_from_gguf(meta, vocab_size, source, file):
    fields, m = gguf_fields(meta, "gemma2", vocab_size, source, file, keys=_KEYS, **GEMMA)
    fields["tie_word_embeddings"] = True  # Gemma ties its head; a file's output.weight is a copy
    return DecoderConfig(
        **fields, **gguf_scales(fields, 46), hidden_act="gelu_pytorch_tanh",
        sliding_window=m.int("attention.sliding_window"),
        layer_types=sliding_layer_types(fields["num_hidden_layers"], full_every=2),
        attn_logit_softcapping=m.float("attn_logit_softcapping", None),
        final_logit_softcapping=m.float("final_logit_softcapping", None))


FAMILY = decoder_family("gemma2", ("gemma2",), config_from_hf, gguf_architecture="gemma2",
                        config_from_gguf=config_from_gguf, hf_renames=None, norm_offset=True)
