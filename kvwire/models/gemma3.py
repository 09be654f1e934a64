"""Gemma 3 (text): Gemma 2's decoder with per-head QK-norm, no attention soft-cap, every
`sliding_window_pattern`-th layer full (6), and two rotaries: full layers on `rope_theta` with its
(linear) scaling, sliding layers on `rope_local_base_freq` unscaled (`local_rope_theta`)."""
from ..layers.rope_scaling import rope_from_hf
from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields, sliding_layer_types
from .decoder.config import LAYER_TYPES
from .gemma2 import GEMMA, gguf_scales, scales

PATTERN, FULL_THETA, LOCAL_THETA = 6, 1_000_000.0, 10_000.0  # transformers' and llama.cpp's
_GEMMA3 = dict(GEMMA, qk_norm="head")
# transformers' Gemma 3 defaults where they differ from DecoderConfig's
_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "num_key_value_heads": 4, "head_dim": 256,
             "max_position_embeddings": 131_072, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1,
             "pad_token_id": 0}


def config_from_hf(d):
    """A `DecoderConfig` from a Gemma 3 text config dict (transformers v4 or v5 form, or a
    multimodal config's `text_config`).

    Example:
        >>> config_from_hf(Gemma3TextConfig(num_hidden_layers=6).to_dict()).layer_types[-1]
        'full_attention'
    """
    if not isinstance(d, dict):
        raise ValueError(f"gemma3 config: expected a config dict (a JSON object), got {type(d).__name__}")
    d = dict(d.get("text_config") if isinstance(d.get("text_config"), dict) else d)
    softcap = d.pop("attn_logit_softcapping", None)
    if softcap is not None:  # transformers' Gemma 3 never applies it
        raise ValueError(f"attn_logit_softcapping={softcap} is not part of Gemma 3 (its reference implementation "
                         f"ignores it); expected None")
    d, local_theta = _rotaries(d)
    pattern, multipliers = _pattern(d), scales(d, d.pop("query_pre_attn_scalar", 256), "gemma3")
    return decoder_config(
        d, "gemma3", keys=("attention_bias", "sliding_window", "layer_types", "final_logit_softcapping"),
        renames={"hidden_activation": "hidden_act"}, defaults=_DEFAULTS, must_be={"tie_word_embeddings": True},
        rope_types=("linear",), sliding={"full_every": pattern}, local_rope_theta=local_theta, **multipliers, **_GEMMA3)


def _pattern(d):
    """transformers v4's `sliding_window_pattern` (every n-th layer full), checked against the
    `layer_types` v5 lists."""
    pattern = d.pop("sliding_window_pattern", None)
    if pattern is None:
        return PATTERN
    if type(pattern) is not int or pattern < 1:
        raise ValueError(f"gemma3 config: sliding_window_pattern={pattern!r}; expected an integer >= 1 "
                         f"(every n-th layer is full)")
    types = d.get("layer_types")
    if isinstance(types, (list, tuple)) and tuple(types) != sliding_layer_types(len(types), full_every=pattern):
        raise ValueError(f"gemma3 config: layer_types {list(types)} contradict sliding_window_pattern={pattern}")
    return pattern


def _rotaries(d):
    """Route the two rotaries' keys: transformers v5 groups them per layer type in `rope_parameters`,
    v4 names the sliding theta `rope_local_base_freq`. Returns (d with the full layers' keys, read as
    every family's are, the sliding layers' theta)."""
    params = d.get("rope_parameters")
    local = {"rope_theta": d.pop("rope_local_base_freq", None)}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"gemma3 config: rope_parameters has {unknown}; expected settings per layer type "
                             f"{list(LAYER_TYPES)}")
        d["rope_parameters"], local["rope_parameters"] = params.get("full_attention"), params.get("sliding_attention")
    given = dict(local)
    theta, scaling, partial = rope_from_hf(local)  # its default theta is Gemma's local one (10k)
    if scaling is not None or partial != 1.0:
        raise ValueError(f"gemma3 config: sliding layers' rope {given['rope_parameters']!r} is scaled; Gemma 3 "
                         f"rotates them unscaled")
    full = d.get("rope_parameters")
    if d.get("rope_theta") is None and not (isinstance(full, dict) and full.get("rope_theta") is not None):
        d["rope_theta"] = FULL_THETA
    return d, theta


_GGUF_KEYS = ("attention.sliding_window", "final_logit_softcapping", "attn_logit_softcapping")


def config_from_gguf(meta, vocab_size, source, file):
    """A `DecoderConfig` from a gemma3 GGUF file's metadata; the sliding pattern and theta are
    llama.cpp's fixed ones."""
    fields, m = gguf_fields(meta, "gemma3", vocab_size, source, file, keys=_GGUF_KEYS, rope_types=("linear",),
                            **_GEMMA3)
    if m.has("attn_logit_softcapping"):
        m.fail("attn_logit_softcapping", "is not part of Gemma 3 (its reference implementation ignores it)")
    if not m.has("rope.freq_base"):
        fields["rope_theta"] = FULL_THETA
    fields["tie_word_embeddings"] = True  # Gemma ties its head; a file's output.weight is a copy
    return DecoderConfig(
        **fields, **gguf_scales(fields, 62), hidden_act="gelu_pytorch_tanh", local_rope_theta=LOCAL_THETA,
        sliding_window=m.int("attention.sliding_window"),
        layer_types=sliding_layer_types(fields["num_hidden_layers"], full_every=PATTERN),
        final_logit_softcapping=m.float("final_logit_softcapping", None))


FAMILY = decoder_family("gemma3", ("gemma3_text", "gemma3"), config_from_hf, gguf_architecture="gemma3",
                        config_from_gguf=config_from_gguf, hf_renames=None, norm_offset=True)
