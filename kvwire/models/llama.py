"""Llama (Llama 2 and 3.x, SmolLM2; Mistral's GGUF files): the shared decoder's defaults.

llama.cpp's converter permutes the Q/K rows of `llama` files (for its interleaved rope); loading
undoes it. Llama 3.x's rope scaling is `rope_scaling={"rope_type": "llama3", ...}` in config.json.
"""
from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_fields


def config_from_hf(d):
    return decoder_config(d, "llama", keys=("attention_bias", "mlp_bias"), defaults={"tie_word_embeddings": False})


def config_from_gguf(meta, vocab_size, source, file):
    fields, _ = gguf_fields(meta, "llama", vocab_size, source, file,
                            attention_bias="blk.0.attn_q.bias" in file.tensor_names)
    return DecoderConfig(**fields)


FAMILY = decoder_family("llama", ("llama",), config_from_hf, gguf_architecture="llama",
                        config_from_gguf=config_from_gguf, permuted_qk=True)
