"""Checkpoint names -> the shared decoder's names, for Hugging Face state dicts and GGUF files.

The tables below are the whole list of renames; the real transforms are few, each a function:
splitting fused projections (Phi-3), llama.cpp's Q/K row permutation (undone for `llama` files),
and Gemma's norm offset (llama.cpp stores the weight with the 1 folded in).
"""
import re

import numpy as np

from ..config import MAX_LAYERS, GGUFMetadata

_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Llama-style checkpoints call their pre-MLP norm post_attention_layernorm (see backbone.py)
PRE_NORM_RENAMES = {"post_attention_layernorm": "pre_feedforward_layernorm"}


def state_from_hf(state, config, renames=None, split=None):
    """HF state dict -> `DecoderBackbone` state dict.

    `renames` maps a block's module names (the part after `layers.N.`) to kvwire's;
    `split(key, value, config) -> {key: value}` handles fused tensors (None: none). A tied
    model's `lm_head.weight` (a copy of the embedding) is dropped; an untied one is kept.
    """
    out = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq") or key.endswith("embed_scale"):
            continue
        for prefix in _HF_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        m = re.fullmatch(r"(layers\.\d+\.)([\w.]+?)\.(weight|bias)", key)
        if m and renames and m.group(2) in renames:
            key = f"{m.group(1)}{renames[m.group(2)]}.{m.group(3)}"
        out.update(split(key, value, config) if split else {key: value})
    return out


def split_rows(key, value, parts, sizes):
    """Rows of a fused weight or bias (out, ...) split into `parts` of `sizes` rows each: {part: rows}."""
    if value.shape[0] != sum(sizes):
        raise ValueError(f"fused tensor {key!r} has {value.shape[0]} rows; expected {sum(sizes)} "
                         f"({' + '.join(map(str, sizes))} for {', '.join(parts)})")
    out, start = {}, 0
    for part, n in zip(parts, sizes):
        out[part] = value[start:start + n]
        start += n
    return out


_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_GGUF_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}


def state_from_gguf(tensors, arch, config, *, permuted_qk=False, norm_offset=False, split=None,
                    optional_biases=False):
    """(GGUF name, numpy array) pairs -> `DecoderBackbone` state dict of numpy arrays.

    permuted_qk: undo llama.cpp's Q/K row permutation (its `llama` converter interleaves each
    head's rotary halves for its NORM rope; transformers' GGUF loader undoes it the same way).
    norm_offset: subtract the 1 that llama.cpp folds into Gemma's norm weights.
    split(key, array, config) -> {key: array}: fused tensors (Phi-3's attn_qkv, ffn_up).
    optional_biases: the blocks' biases are optional, each on its own (llama.cpp's `llama`): a
    block without one of the biases the config turns on (`gguf_biases`) gets zeros.
    """
    out = {}
    for name, array in tensors:
        if name in _ROPE_TENSORS:  # read into the config's rope scaling, not weights
            continue
        key = _GGUF_TOP.get(name)
        if name == "output.weight" and config.tie_word_embeddings:
            continue  # some tied files carry a copy of the embedding
        if key is None:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
            if not m or m.group(2) not in _GGUF_BLOCK and not (split and m.group(2) in ("attn_qkv",)):
                raise ValueError(f"unexpected tensor {name!r} in a {arch} GGUF file")
            part = _GGUF_BLOCK.get(m.group(2), m.group(2))
            key = f"layers.{m.group(1)}.{part}.{m.group(3)}"
            if permuted_qk and m.group(2) in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if m.group(2) == "attn_q" else config.num_key_value_heads
                array = unpermute_qk(array, heads, name)
        if norm_offset and key.endswith("norm.weight"):
            array = array - 1.0
        out.update(split(key, array, config) if split else {key: array})
    if optional_biases:
        _zero_biases(out, config)
    return out


# the bias groups of `DecoderConfig` (field: llama.cpp's tensors); ffn_down's is per layer (mlp_out_bias)
_BIAS_GROUPS = {"attention_bias": ("attn_q", "attn_k", "attn_v"), "attention_out_bias": ("attn_output",),
                "mlp_bias": ("ffn_gate", "ffn_up")}


def gguf_biases(names, n_layers):
    """The `DecoderConfig` bias fields of a file whose blocks may each carry any of the biases
    llama.cpp's `llama` reads (q, k, v, attn_output, ffn_gate, ffn_up, ffn_down, every one optional):
    a group is on where any block has one of its tensors (`state_from_gguf(optional_biases=True)`
    gives the others zeros); ffn_down's is per block, as a baked steer writes it on the steered
    blocks only (`kvwire.steer.bake_steer`).

    Example:
        >>> gguf_biases({"blk.1.ffn_down.bias", "blk.0.attn_q.bias"}, 2)
        {'attention_bias': True, 'attention_out_bias': False, 'mlp_bias': False, 'mlp_out_bias': (False, True)}
    """
    found = [m.groups() for m in (re.fullmatch(r"blk\.(\d+)\.(\w+)\.bias", n) for n in names) if m]
    have, down = {part for _, part in found}, {int(i) for i, part in found if part == "ffn_down"}
    fields = {field: any(t in have for t in parts) for field, parts in _BIAS_GROUPS.items()}
    sized = type(n_layers) is int and 0 <= n_layers <= MAX_LAYERS  # else DecoderConfig refuses the count
    return {**fields, "mlp_out_bias": tuple(i in down for i in range(n_layers)) if down and sized else bool(down)}


def _zero_biases(out, config):
    """Zeros (in place) for the biases `config` gives a block that the file left out."""
    c = config
    rows = {"attn_q": c.num_attention_heads * c.head_dim, "attn_k": c.num_key_value_heads * c.head_dim,
            "attn_v": c.num_key_value_heads * c.head_dim, "attn_output": c.hidden_size,
            "ffn_gate": c.intermediate_size, "ffn_up": c.intermediate_size}
    for i in range(c.num_hidden_layers):
        for field, parts in _BIAS_GROUPS.items():
            for part in parts if getattr(c, field) else ():
                out.setdefault(f"layers.{i}.{_GGUF_BLOCK[part]}.bias", np.zeros(rows[part], np.float32))


def unpermute_qk(rows, heads, name="tensor"):
    """Undo llama.cpp's `permute`: per head, its rows were reordered from [first half, second half]
    (rotate-half) to interleaved pairs. rows (out, ...) with out = heads * head_dim -> same shape.
    Only whole rows move, so this also maps row numbers (see quant.ggml's `use_gguf_blocks`)."""
    out = rows.shape[0]
    if out % (2 * heads):
        raise ValueError(f"GGUF tensor {name!r} has {out} rows, which do not split into {heads} heads of even size")
    return np.ascontiguousarray(rows.reshape(heads, out // heads // 2, 2, *rows.shape[1:])
                                .swapaxes(1, 2).reshape(rows.shape))


# the keys llama.cpp writes for these architectures; any other `<arch>.*` key raises (GGUFMetadata)
GGUF_KEYS = frozenset("""
context_length embedding_length block_count feed_forward_length vocab_size attention.head_count
attention.head_count_kv attention.key_length attention.value_length attention.layer_norm_rms_epsilon
rope.freq_base rope.dimension_count rope.scaling.type rope.scaling.factor rope.scaling.original_context_length
rope.scaling.finetuned rope.scaling.yarn_ext_factor rope.scaling.yarn_attn_factor rope.scaling.yarn_beta_fast
rope.scaling.yarn_beta_slow
""".split())


def config_from_gguf(meta, arch, vocab_size, source, file, *, keys=(), rope_types=("linear", "yarn"), **fields):
    """The `DecoderConfig` fields every llama-like GGUF file gives, plus `fields` from the family.
    Keys llama.cpp requires are required; the others take llama.cpp's defaults. `keys`: more
    `<arch>.*` keys the family reads itself (through the returned `GGUFMetadata`); `file`: the
    `GGUFFile` (its tensor names; Llama 3.x's `rope_freqs` factors); `rope_types`: the
    rope.scaling.type values the family implements besides "none".

    Returns (fields dict for DecoderConfig, the GGUFMetadata)."""
    m = GGUFMetadata(meta, arch, GGUF_KEYS | set(keys), source)
    heads, hidden = m.int("attention.head_count"), m.int("embedding_length")
    head_dim = m.int("attention.key_length", hidden // heads)
    if m.int("attention.value_length", head_dim) != head_dim:
        m.fail("attention.value_length", f"= {meta[f'{arch}.attention.value_length']} differs from the key "
               f"length {head_dim}; kvwire uses one head size")
    rotary = m.int("rope.dimension_count", head_dim)
    if m.int("vocab_size", vocab_size) != vocab_size:
        m.fail("vocab_size", f"= {meta[f'{arch}.vocab_size']}, but the tokenizer lists {vocab_size} tokens")
    names = file.tensor_names
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=m.int("feed_forward_length"),
        num_hidden_layers=m.int("block_count"), num_attention_heads=heads,
        num_key_value_heads=m.int("attention.head_count_kv", heads), head_dim=head_dim,
        max_position_embeddings=m.int("context_length"),
        rms_norm_eps=m.float("attention.layer_norm_rms_epsilon", strict=False),
        rope_theta=m.float("rope.freq_base", 10_000.0), rope_scaling=_rope_scaling(m, rope_types, file),
        partial_rotary_factor=rotary / head_dim, tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        **fields), m


def _rope_scaling(m, types, file):
    """The file's rope scaling, in transformers' form: Phi-3's longrope factor tensors, Llama 3.x's
    `rope_freqs` (llama3's scaling, precomputed per frequency), or rope.scaling.type."""
    names = file.tensor_names
    if "rope_factors_long.weight" in names:
        return {"rope_type": "longrope", "long_factor": file.tensor("rope_factors_long.weight").tolist(),
                "short_factor": file.tensor("rope_factors_short.weight").tolist(),
                "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
                "attention_factor": m.float("rope.scaling.attn_factor", None)}
    scaling = _rope_scaling_type(m, types)
    if "rope_freqs.weight" in names:
        if scaling is not None:
            m.fail("rope.scaling.type", f"= {scaling['rope_type']!r} and a rope_freqs tensor: expected one scaling")
        return {"rope_type": "frequency_factors", "frequency_factors": file.tensor("rope_freqs.weight").tolist()}
    return scaling


def _rope_scaling_type(m, types):
    """llama.cpp's rope.scaling.type: "none" or one of `types` ("linear", "yarn"; a missing or zero
    factor means 1, as in llama.cpp); others are refused: loading them unscaled would be a wrong model."""
    kind = m.str("rope.scaling.type", "none")
    if kind != "none" and kind not in types:
        known = ["'none'", *(repr(t) for t in types)]
        m.fail("rope.scaling.type", f"= {kind!r} is not supported (kvwire reads {', '.join(known[:-1])} and "
               f"{known[-1]} for this architecture)")
    factor = m.float("rope.scaling.factor", 0.0, strict=False)
    if kind == "none" or factor in (0.0, 1.0):
        return None
    if kind == "yarn":
        if m.float("rope.scaling.yarn_ext_factor", 1.0, strict=False) != 1.0:
            m.fail("rope.scaling.yarn_ext_factor", "is not 1.0; transformers' yarn has no extrapolation factor")
        optional = {"attention_factor": "yarn_attn_factor", "beta_fast": "yarn_beta_fast",
                    "beta_slow": "yarn_beta_slow"}
        read = {name: m.float(f"rope.scaling.{key}", None, strict=False) for name, key in optional.items()}
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
                **{k: v for k, v in read.items() if v is not None}}
    return {"rope_type": "linear", "factor": factor}
