"""Hugging Face config dicts -> `DecoderConfig`: the part every family's mapping shares.

A family says which HF keys it reads beyond the common ones, which keys have a single supported
value, and the decoder fields that are fixed for it (its norm placement, biases, ...). Any other key
raises: a key kvwire does not read may change the computation.
"""
import dataclasses

from ...layers.rope_scaling import rope_from_hf
from ..config import read_hf
from .config import DecoderConfig, sliding_layer_types

# keys with the same name and meaning in every family's config.json
COMMON = frozenset("""
vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
hidden_act max_position_embeddings rms_norm_eps tie_word_embeddings bos_token_id eos_token_id pad_token_id
""".split())
# the rope keys of transformers v4 and v5, read by `rope_from_hf`
ROPE_KEYS = frozenset({"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
                       "original_max_position_embeddings"})
# keys whose only supported value is fixed, in every family that has them
MUST_BE = {"pretraining_tp": 1, "use_bidirectional_attention": False, "attention_dropout": 0.0}


def decoder_config(d, family, *, keys=(), renames=None, must_be=None, defaults=None, sliding=None, rope_aliases=None,
                   rope_types=None, **fixed):
    """A `DecoderConfig` from HF config dict `d` (transformers v4 or v5 form).

    Args:
        family: its name, for errors. keys: HF keys read besides COMMON and the rope keys (same
            name as the field).
        renames: {HF key: decoder field} for keys spelled differently. must_be: {HF key: the only
            supported value} (None in `d` counts as absent). defaults: {HF key: value} where the
            family's transformers default differs from DecoderConfig's (e.g. tie_word_embeddings).
            sliding: the family's window pattern ({} = every layer; `sliding_layer_types`' keywords),
            giving `layer_types` when `d` has a window but lists none (transformers v4 files).
            rope_aliases: the family's other names of rope types (`rope_from_hf`'s aliases).
            rope_types: the scaling types the family implements (None: all of `Rotary`'s).
            fixed: decoder fields set by the family.

    Example:
        >>> decoder_config(llama_config.to_dict(), "llama", keys=("attention_bias", "mlp_bias"))
    """
    where = f"{family} config"
    kwargs = read_hf(d, where, COMMON | ROPE_KEYS | set(keys), renames=renames, must_be={**MUST_BE, **(must_be or {})},
                     defaults=defaults)
    rope = {k: kwargs.pop(k) for k in ROPE_KEYS if k in kwargs}
    theta, scaling, partial = rope_from_hf({**rope, "max_position_embeddings": kwargs.get("max_position_embeddings")},
                                           rope_aliases)
    if rope_types is not None and scaling is not None and scaling["rope_type"] not in rope_types:
        raise ValueError(f"{where}: rope_scaling {scaling!r} is not supported (kvwire reads "
                         f"{', '.join(map(repr, rope_types))} for {family})")
    kwargs.update(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)
    if sliding is not None and kwargs.get("layer_types") is None:  # transformers v4 files list none
        kwargs.pop("layer_types", None)
        n = kwargs.get("num_hidden_layers")
        if kwargs.get("sliding_window") is not None and type(n) is int:  # a bad count is DecoderConfig's to name
            fixed = {**fixed, "layer_types": sliding_layer_types(n, **sliding)}
    clash = sorted(set(kwargs) & set(fixed))
    if clash:  # a family's fixed choice is never overridden silently
        raise ValueError(f"{where}: {clash} cannot be set for this family")
    missing = sorted(f.name for f in dataclasses.fields(DecoderConfig)
                     if f.default is dataclasses.MISSING and f.name not in kwargs and f.name not in fixed)
    if missing:
        raise ValueError(f"{where}: missing required fields {missing}")
    return DecoderConfig(**kwargs, **fixed)

