"""Granite: Llama with four scalar multipliers: embeddings, q.k (attention_multiplier replaces
head_dim ** -0.5), each residual branch, and logits (divided by logits_scaling)."""
from .decoder import decoder_config, decoder_family


def config_from_hf(d):
    return decoder_config(d, "granite", keys=("attention_bias", "mlp_bias", "residual_multiplier", "logits_scaling"),
                          renames={"embedding_multiplier": "embedding_scale", "attention_multiplier": "query_scale"},
                          defaults={"tie_word_embeddings": False, "embedding_multiplier": 1.0,
                                    "attention_multiplier": 1.0})


FAMILY = decoder_family("granite", ("granite",), config_from_hf)
