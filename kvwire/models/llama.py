"""Llama (Llama 2 and 3.x, SmolLM2; Mistral's GGUF files): the shared decoder's defaults.

llama.cpp's converter permutes the Q/K rows of `llama` files (for its interleaved rope); loading
undoes it. Llama 3.x's rope scaling is `rope_scaling={"rope_type": "llama3", ...}` in config.json.
"""
from .decoder import DecoderConfig, decoder_config, decoder_family, gguf_biases, gguf_fields


def config_from_hf(d):
    return decoder_config(d, "llama", keys=("attention_bias", "mlp_bias"), defaults={"tie_word_embeddings": False})


def config_from_gguf(meta, vocab_size, source, file):
    fields, _ = gguf_fields(meta, "llama", vocab_size, source, file)
    # llama.cpp reads each bias of a llama block where the file has one (a baked steer's ffn_down.bias)
    return DecoderConfig(**fields, **gguf_biases(file.tensor_names, fields["num_hidden_layers"]))


FAMILY = decoder_family("llama", ("llama",), config_from_hf, gguf_architecture="llama",
                        config_from_gguf=config_from_gguf, permuted_qk=True, optional_biases=True)
