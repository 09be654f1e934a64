"""Mistral: Llama's decoder with one sliding window on every layer (`sliding_window`, None = full).
llama.cpp writes Mistral as `llama` (the llama family reads those files)."""
from .decoder import decoder_config, decoder_family


def config_from_hf(d):
    return decoder_config(d, "mistral", keys=("sliding_window",), defaults={"tie_word_embeddings": False}, sliding={})


FAMILY = decoder_family("mistral", ("mistral",), config_from_hf)
