"""Tiny random Hugging Face models of every decoder family (transformers is the arbiter).

`tiny_hf(family, seed=0, **overrides)` builds a transformers model (eval mode) whose weights are
spread wide enough that tokens differ and attention is far from uniform. Every family shares the
same small sizes; `overrides` are config fields in transformers' own spelling.
"""
import torch

# one vocabulary and width for all: 96 tokens, width 32, 4 heads of 8, GQA 4/2, 4 layers
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0)

# family -> (transformers config class, causal-LM class, family defaults)
SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=8, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=8, sliding_window=5, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=1.7, attention_multiplier=0.2,
                                                            residual_multiplier=0.6, logits_scaling=2.5,
                                                            tie_word_embeddings=False)),
}


def tiny_hf(family, seed=0, **overrides):
    """A tiny random transformers model of `family` (a key of SPECS), float32, eval mode."""
    import transformers

    config_name, model_name, defaults = SPECS[family]
    torch.manual_seed(seed)
    settings = {**_COMMON, **defaults, **overrides}
    config = getattr(transformers, config_name)(**settings)
    model = getattr(transformers, model_name)(config).eval()
    spread(model)
    return model


def spread(model):
    """Random weights large enough that tokens differ and attention is far from uniform."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.2)
