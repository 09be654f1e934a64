"""Gemma 2: Gemma's norms in the sandwich placement, attention and final logit soft-capping,
q.k scaled by query_pre_attn_scalar, sliding windows on alternate layers (`layer_types`)."""
import math

from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields

_GEMMA = dict(norm_placement="sandwich", norm_offset=True, float32_residual=True)


def config_from_hf(d):
    d = dict(d)
    scalar = d.pop("query_pre_attn_scalar", 256)
    hidden, n = d.get("hidden_size", 2304), d.get("num_hidden_layers", 26)
    if d.get("layer_types") is None and type(n) is int:  # transformers' pattern: even layers slide
        d["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return decoder_config(
        d, "gemma2", keys=("attention_bias", "sliding_window", "layer_types", "attn_logit_softcapping",
                           "final_logit_softcapping"),
        renames={"hidden_activation": "hidden_act"},
        defaults={"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                  "final_logit_softcapping": 30.0},
        query_scale=_scale(scalar), embedding_scale=math.sqrt(hidden) if type(hidden) is int else None, **_GEMMA)


def _scale(scalar):
    if type(scalar) not in (int, float) or not scalar > 0:
        raise ValueError(f"gemma2 config: query_pre_attn_scalar={scalar!r}; expected a positive number")
    return scalar**-0.5


_KEYS = ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


def config_from_gguf(meta, vocab_size, source, file):
    fields, m = gguf_fields(meta, "gemma2", vocab_size, source, file, keys=_KEYS, **_GEMMA)
    n, hidden, heads = fields["num_hidden_layers"], fields["hidden_size"], fields["num_attention_heads"]
    # no query_pre_attn_scalar in the file: like llama.cpp, head_dim, but hidden / heads for the
    # 46-layer 27B model
    scalar = hidden // heads if n == 46 else fields["head_dim"]
    fields["tie_word_embeddings"] = True  # Gemma ties its head; a file's output.weight is a copy
    return DecoderConfig(
        **fields, hidden_act="gelu_pytorch_tanh", query_scale=scalar**-0.5, embedding_scale=math.sqrt(hidden),
        sliding_window=m.int("attention.sliding_window"),
        layer_types=tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)),
        attn_logit_softcapping=m.float("attn_logit_softcapping", None),
        final_logit_softcapping=m.float("final_logit_softcapping", None))


FAMILY = decoder_family("gemma2", ("gemma2",), config_from_hf, gguf_architecture="gemma2",
                        config_from_gguf=config_from_gguf, hf_renames=None, norm_offset=True)
