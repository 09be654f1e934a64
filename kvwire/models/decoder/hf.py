"""Hugging Face config dicts -> `DecoderConfig`: the part every family's mapping shares.

A family says which HF keys it reads beyond the common ones, which keys have a single supported
value, and the decoder fields that are fixed for it (its norm placement, biases, ...). Any other key
raises: a key kvwire does not read may change the computation.
"""
import dataclasses

from ...layers.rope_scaling import rope_from_hf
from ..config import HF_BOOKKEEPING
from .config import DecoderConfig

# keys with the same name and meaning in every family's config.json
COMMON = frozenset("""
vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
hidden_act max_position_embeddings rms_norm_eps tie_word_embeddings bos_token_id eos_token_id pad_token_id
""".split())
# keys whose only supported value is fixed, in every family that has them
MUST_BE = {"pretraining_tp": 1, "use_bidirectional_attention": False, "attention_dropout": 0.0}


def decoder_config(d, family, *, keys=(), renames=None, must_be=None, defaults=None, **fixed):
    """A `DecoderConfig` from HF config dict `d` (transformers v4 or v5 form).

    Args:
        family: its name, for errors. keys: HF keys read besides COMMON (same name as the field).
        renames: {HF key: decoder field} for keys spelled differently. must_be: {HF key: the only
            supported value} (None in `d` counts as absent). defaults: {HF key: value} where the
            family's transformers default differs from DecoderConfig's (e.g. tie_word_embeddings).
            fixed: decoder fields set by the family.

    Example:
        >>> decoder_config(llama_config.to_dict(), "llama", keys=("attention_bias", "mlp_bias"))
    """
    if not isinstance(d, dict):
        raise ValueError(f"{family} config: expected a config dict (a JSON object), got {type(d).__name__}")
    d = {**(defaults or {}), **d}  # a key given as None stays None (Gemma 2: no soft-cap)
    theta, scaling, partial = rope_from_hf(d)  # pops the rope keys of either form
    renames, must_be = renames or {}, {**MUST_BE, **(must_be or {})}
    kwargs, unknown = {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial}, []
    for key, value in d.items():
        if key in must_be:
            want = must_be[key]
            if value is not None and (type(value) is not type(want) or value != want):
                raise ValueError(f"{family} config: {key}={value!r} is not supported (expected {want!r})")
        elif key in renames:
            kwargs[renames[key]] = value
        elif key in COMMON or key in keys:
            kwargs[key] = value
        elif key not in HF_BOOKKEEPING:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{family} config: unknown fields {sorted(unknown)}")
    clash = sorted(set(kwargs) & set(fixed))
    if clash:  # a family's fixed choice is never overridden silently
        raise ValueError(f"{family} config: {clash} cannot be set for this family")
    missing = sorted(f.name for f in dataclasses.fields(DecoderConfig)
                     if f.default is dataclasses.MISSING and f.name not in kwargs and f.name not in fixed)
    if missing:
        raise ValueError(f"{family} config: missing required fields {missing}")
    return DecoderConfig(**kwargs, **fixed)


def sliding_layer_types(d, n_layers, first_sliding=0):
    """`layer_types` for families whose window covers layers from `first_sliding` on (Qwen 2's
    max_window_layers) when the config lists none (transformers v4 files)."""
    if d.get("layer_types") is not None or d.get("sliding_window") is None:
        return d.get("layer_types")
    return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(n_layers)]
