"""Mistral: Llama's decoder with one sliding window on every layer (`sliding_window`, None = full).
llama.cpp writes Mistral as `llama` (the llama family reads those files)."""
from .decoder import decoder_config, decoder_family


def config_from_hf(d):
    n, window = d.get("num_hidden_layers"), d.get("sliding_window")
    types = None if window is None or type(n) is not int else ("sliding_attention",) * n
    return decoder_config(d, "mistral", keys=("sliding_window",), defaults={"tie_word_embeddings": False},
                          layer_types=types)


FAMILY = decoder_family("mistral", ("mistral",), config_from_hf)
