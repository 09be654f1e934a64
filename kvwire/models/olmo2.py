"""OLMo 2: norms *after* attention and the MLP (its `post_attention_layernorm` is a post norm),
RMSNorm over the full query and key projections before the head split."""
from .decoder import decoder_config, decoder_family


def config_from_hf(d):
    return decoder_config(d, "olmo2", keys=("attention_bias",), defaults={"tie_word_embeddings": False},
                          norm_placement="post", qk_norm="full")


FAMILY = decoder_family("olmo2", ("olmo2",), config_from_hf, hf_renames=None)
