"""Gemma 3 converters: Hugging Face state dicts and GGUF files -> the shared decoder's names.

Module names already follow the HF checkpoint, so HF conversion only strips prefixes. GGUF names
are llama.cpp's; llama.cpp also stores Gemma norm weights with the +1 folded in, which we undo.
"""
from ..config import GGUFMetadata
from ..decoder import convert
from .config import Gemma3Config


def state_from_hf(state, config=None):
    """HF Gemma3ForCausalLM/Gemma3TextModel state dict -> backbone state dict (names are the
    shared decoder's already; the head is tied)."""
    return convert.state_from_hf(state, _TIED)


def state_from_gguf(tensors, config=None):
    """(gguf name, numpy array) pairs -> backbone state dict of numpy arrays."""
    return convert.state_from_gguf(tensors, "gemma3", _TIED, norm_offset=True)


class _TIED:  # Gemma 3 always ties its head: an untied copy some files carry is dropped
    tie_word_embeddings = True


# the gemma3 keys llama.cpp writes or reads; any other `gemma3.*` key raises (GGUFMetadata)
_GGUF_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "final_logit_softcapping", "attn_logit_softcapping",
}


def config_from_gguf(meta, vocab_size, source="GGUF metadata", file=None):
    """Gemma3Config from GGUF metadata. Keys llama.cpp requires are required here too; the others
    take llama.cpp's defaults. Errors name `source` (the file) and the key."""
    m = GGUFMetadata(meta, "gemma3", _GGUF_KEYS, source)
    heads, layers, hidden = m.int("attention.head_count"), m.int("block_count"), m.int("embedding_length")
    head_dim = m.int("attention.key_length", 256)
    if m.int("attention.value_length", head_dim) != head_dim:  # one head_dim for keys and values
        m.fail("attention.value_length", f"= {meta['gemma3.attention.value_length']} differs from "
               f"attention.key_length = {head_dim}; Gemma 3 uses one head size")
    if m.int("rope.dimension_count", head_dim) != head_dim:  # rope turns the whole head
        m.fail("rope.dimension_count", f"= {meta['gemma3.rope.dimension_count']}; expected the head size {head_dim}")
    if m.int("vocab_size", vocab_size) != vocab_size:
        m.fail("vocab_size", f"= {meta['gemma3.vocab_size']}, but the tokenizer lists {vocab_size} tokens")
    # The file has no query_pre_attn_scalar; like llama.cpp, use head_dim, except for the 62-layer
    # 27B model, whose scalar is hidden_size / heads.
    query_scalar = hidden // heads if layers == 62 else head_dim
    return Gemma3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=m.int("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=m.int("attention.head_count_kv", heads),
        head_dim=head_dim,
        query_pre_attn_scalar=query_scalar,
        max_position_embeddings=m.int("context_length"),
        rms_norm_eps=m.float("attention.layer_norm_rms_epsilon", strict=False),
        sliding_window=m.int("attention.sliding_window"),
        rope_theta=m.float("rope.freq_base", 1_000_000.0),
        rope_scaling=_rope_scaling(m),
        final_logit_softcapping=m.float("final_logit_softcapping", None),
        attn_logit_softcapping=m.float("attn_logit_softcapping", None),
    )


def _rope_scaling(m):
    """llama.cpp's rope.scaling.type: "none" or "linear" (full layers, by rope.scaling.factor; a
    missing or zero factor means 1, as in llama.cpp). Other types (yarn, longrope) are refused, as
    `Gemma3Config` refuses them from config.json: loading them unscaled would be a wrong model."""
    kind = m.str("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        m.fail("rope.scaling.type", f"= {kind!r} is not supported (Gemma 3 implements 'none' and 'linear')")
    factor = m.float("rope.scaling.factor", 0.0, strict=False)
    if kind == "none" or factor in (0.0, 1.0):
        return None
    return {"rope_type": "linear", "factor": factor}
