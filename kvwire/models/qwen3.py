"""Qwen 3: Qwen 2's windows, per-head RMSNorm on queries and keys, `attention_bias` on all four
projections (none by default)."""
from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields
from .qwen2 import WINDOW_KEYS, windows


def config_from_hf(d):
    d, sliding = windows(d)
    return decoder_config(d, "qwen3", keys=("attention_bias", *WINDOW_KEYS), defaults={"tie_word_embeddings": False},
                          sliding=sliding, qk_norm="head")


def config_from_gguf(meta, vocab_size, source, file):
    fields, _ = gguf_fields(meta, "qwen3", vocab_size, source, file, qk_norm="head",
                            attention_bias="blk.0.attn_q.bias" in file.tensor_names)
    return DecoderConfig(**fields)


FAMILY = decoder_family("qwen3", ("qwen3",), config_from_hf, gguf_architecture="qwen3",
                        config_from_gguf=config_from_gguf)
