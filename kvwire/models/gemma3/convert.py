"""Gemma 3 converters: Hugging Face state dicts and GGUF files -> kvwire names.

Module names already follow the HF checkpoint, so HF conversion only strips prefixes. GGUF names
are llama.cpp's; llama.cpp also stores Gemma norm weights with the +1 folded in, which we undo.
"""
import re

from .config import Gemma3Config

_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_HF_SKIP = ("lm_head.weight",)  # tied to the embedding


def state_from_hf(state):
    """HF Gemma3ForCausalLM/Gemma3TextModel state dict -> backbone state dict."""
    out = {}
    for key, value in state.items():
        if key in _HF_SKIP or key.endswith("embed_scale") or key.endswith("rotary_emb.inv_freq"):
            continue
        for prefix in _HF_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        out[key] = value
    return out


_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}


def state_from_gguf(tensors):
    """(gguf name, numpy array) pairs -> backbone state dict of numpy arrays."""
    out = {}
    for name, array in tensors:
        if name == "output.weight":  # an untied copy of the embedding some files carry
            continue
        key = _GGUF_TOP.get(name)
        if key is None:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
            if not m or m.group(2) not in _GGUF_BLOCK:
                raise ValueError(f"unexpected tensor {name!r} in a gemma3 GGUF file")
            key = f"layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
        if key.endswith("norm.weight"):
            array = array - 1.0
        out[key] = array
    return out


def config_from_gguf(meta, vocab_size):
    """Gemma3Config from GGUF metadata; fields the file omits take the defaults llama.cpp uses."""
    a = "gemma3."
    scaling = None
    head_dim = meta.get(a + "attention.key_length", 256)
    # The file has no query_pre_attn_scalar; like llama.cpp, use head_dim, except for the 62-layer
    # 27B model, whose scalar is hidden_size / heads.
    query_scalar = head_dim
    if meta[a + "block_count"] == 62:
        query_scalar = meta[a + "embedding_length"] // meta[a + "attention.head_count"]
    if meta.get(a + "rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[a + "rope.scaling.factor"])}
    return Gemma3Config(
        vocab_size=vocab_size,
        hidden_size=meta[a + "embedding_length"],
        intermediate_size=meta[a + "feed_forward_length"],
        num_hidden_layers=meta[a + "block_count"],
        num_attention_heads=meta[a + "attention.head_count"],
        num_key_value_heads=meta.get(a + "attention.head_count_kv", meta[a + "attention.head_count"]),
        head_dim=head_dim,
        query_pre_attn_scalar=query_scalar,
        max_position_embeddings=meta.get(a + "context_length", 32_768),
        rms_norm_eps=meta.get(a + "attention.layer_norm_rms_epsilon", 1e-6),
        sliding_window=meta.get(a + "attention.sliding_window", 512),
        rope_theta=meta.get(a + "rope.freq_base", 1_000_000.0),
        rope_scaling=scaling,
    )
