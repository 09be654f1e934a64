"""Shared helpers for model configs: frozen dataclasses built from Hugging Face config dicts or
GGUF metadata, with every value checked (type, range) before a backbone is sized by it."""
import dataclasses
import math

# Bookkeeping keys of Hugging Face configs that do not change the computation.
HF_BOOKKEEPING = frozenset("""
architectures model_type transformers_version torch_dtype dtype _name_or_path use_cache return_dict
output_hidden_states output_attentions torchscript tie_encoder_decoder is_encoder_decoder is_decoder
add_cross_attention cross_attention_hidden_size pruned_heads chunk_size_feed_forward id2label label2id
problem_type tokenizer_class prefix task_specific_params finetuning_task bad_words_ids begin_suppress_tokens
decoder_start_token_id sep_token_id suppress_tokens forced_bos_token_id forced_eos_token_id
initializer_range attention_dropout embd_pdrop resid_pdrop attn_pdrop summary_type summary_use_proj
summary_activation summary_proj_to_labels summary_first_dropout n_ctx use_return_dict output_scores
return_dict_in_generate max_length min_length do_sample early_stopping num_beams num_beam_groups
diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty
no_repeat_ngram_size encoder_no_repeat_ngram_size num_return_sequences remove_invalid_values
exponential_decay_length_penalty tf_legacy_loss use_bfloat16 cache_implementation
_attn_implementation_autoset _sliding_window_pattern base_model_tp_plan base_model_pp_plan
""".split())


def read_hf(d, where, fields, *, renames=None, must_be=None, defaults=None):
    """{field: value} from Hugging Face config dict `d`, for a family's config.

    Args:
        where: what errors name ("llama config"). fields: keys read under their own name.
        renames: {HF key: field} for keys spelled differently. must_be: {HF key: the only supported
            value} (None in `d` counts as absent). defaults: {HF key: value} for keys `d` lacks.

    Any other key that is not bookkeeping (HF_BOOKKEEPING) raises: a key kvwire does not read may
    change the computation.

    Example:
        >>> read_hf({"n_embd": 32, "use_cache": True}, "gpt2 config", {"n_embd"})
        {'n_embd': 32}
    """
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a config dict (a JSON object), got {type(d).__name__}")
    renames, must_be = renames or {}, must_be or {}
    kwargs, unknown = {}, []
    for key, value in {**(defaults or {}), **d}.items():  # a key given as None stays None
        if key in must_be:
            want = must_be[key]
            if value is not None and (type(value) is not type(want) or value != want):
                raise ValueError(f"{where}: {key}={value!r} is not supported (expected {want!r})")
        elif key in renames:
            kwargs[renames[key]] = value
        elif key in fields:
            kwargs[key] = value
        elif key not in HF_BOOKKEEPING:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{where}: unknown config fields {sorted(unknown)}")
    return kwargs


def _is_int(v):
    return type(v) is int  # bool is an int subclass, and never a size


def _is_number(v):
    return type(v) in (int, float) and math.isfinite(v)


_CHECKS = {int: (_is_int, "an integer"), float: (_is_number, "a finite number"),
           bool: (lambda v: type(v) is bool, "true or false"), str: (lambda v: type(v) is str, "a string")}


MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS; a corrupt count must not build a billion blocks


def check_fields(config, positive=(), layers=None):
    """Raise a ValueError naming the field for a value of the wrong type (a string where an int
    belongs, a NaN), a `positive` field that is not > 0, a token id that is not an id, or a
    `layers` count above MAX_LAYERS.

    A field whose default is None may be None; `*_token_id` fields may be None or ids (>= 0)."""
    name = type(config).__name__
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None and (f.default is None or f.name.endswith("_token_id")):
            continue
        if f.name.endswith("_token_id"):
            ids = value if isinstance(value, (list, tuple)) else [value]
            if not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"{name}: {f.name}={value!r}; expected a token id (an integer >= 0) or a list of them")
            continue
        check, expected = _CHECKS.get(f.type, (None, None))
        if check is not None and not check(value):
            raise ValueError(f"{name}: {f.name}={value!r} ({type(value).__name__}); expected {expected}")
        if f.name in positive and not value > 0:
            raise ValueError(f"{name}: {f.name}={value!r}; expected a positive value")
        if f.name == layers and value > MAX_LAYERS:
            raise ValueError(f"{name}: {f.name}={value}; expected at most {MAX_LAYERS} layers")


REQUIRED = object()


class GGUFMetadata:
    """Typed reads of one architecture's GGUF keys, for a family's `config_from_gguf`.

    Errors name the file (`source`) and the key, and say what was found and what was expected.
    Keys under `<arch>.` that the family does not list in `known` raise, as unknown config.json
    fields do: a key kvwire does not read may change the computation (or be a corrupt name).

    Example:
        >>> m = GGUFMetadata(gguf.metadata, "gpt2", {"block_count"}, gguf.path)
        >>> m.int("block_count")
        12
    """

    def __init__(self, meta, arch, known, source="GGUF metadata"):
        self.meta, self.prefix, self.source = meta, arch + ".", source
        unknown = sorted(k for k in meta if k.startswith(self.prefix) and k[len(self.prefix):] not in known)
        if unknown:
            raise ValueError(f"{source}: unknown metadata {unknown} for a {arch} model (kvwire does not know "
                             f"what it changes); known: {sorted(known)}")

    def has(self, key):
        return self.prefix + key in self.meta

    def _get(self, key, default, check, expected):
        full = self.prefix + key
        if full not in self.meta:
            if default is REQUIRED:
                raise ValueError(f"{self.source} has no {full!r}, which a {self.prefix[:-1]} model needs")
            return default
        value = self.meta[full]
        if not check(value):
            raise ValueError(f"{self.source}: {full} = {value!r} ({type(value).__name__}); expected {expected}")
        return value

    def int(self, key, default=REQUIRED, minimum=1):
        return self._get(key, default, lambda v: _is_int(v) and v >= minimum, f"an integer >= {minimum}")

    def float(self, key, default=REQUIRED, minimum=0.0, strict=True):
        """A finite number above `minimum` (or equal to it when not `strict`), as a float."""
        ok = (lambda v: _is_number(v) and v > minimum) if strict else (lambda v: _is_number(v) and v >= minimum)
        value = self._get(key, default, ok, f"a finite number {'>' if strict else '>='} {minimum}")
        return value if value is default else float(value)

    def str(self, key, default=REQUIRED):
        return self._get(key, default, lambda v: type(v) is str, "a string")

    def fail(self, key, message):
        raise ValueError(f"{self.source}: {self.prefix}{key} {message}")
