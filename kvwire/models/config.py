"""Shared helpers for model configs: frozen dataclasses built from Hugging Face config dicts."""
import dataclasses

# Bookkeeping keys of Hugging Face configs that do not change the computation.
HF_BOOKKEEPING = frozenset("""
architectures model_type transformers_version torch_dtype dtype _name_or_path use_cache return_dict
output_hidden_states output_attentions torchscript tie_encoder_decoder is_encoder_decoder is_decoder
add_cross_attention cross_attention_hidden_size pruned_heads chunk_size_feed_forward id2label label2id
problem_type tokenizer_class prefix task_specific_params finetuning_task bad_words_ids begin_suppress_tokens
decoder_start_token_id sep_token_id suppress_tokens forced_bos_token_id forced_eos_token_id
initializer_range attention_dropout embd_pdrop resid_pdrop attn_pdrop summary_type summary_use_proj
summary_activation summary_proj_to_labels summary_first_dropout n_ctx use_return_dict output_scores
return_dict_in_generate max_length min_length do_sample early_stopping num_beams num_beam_groups
diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty
no_repeat_ngram_size encoder_no_repeat_ngram_size num_return_sequences remove_invalid_values
exponential_decay_length_penalty tf_legacy_loss use_bfloat16 cache_implementation
_attn_implementation_autoset _sliding_window_pattern base_model_tp_plan base_model_pp_plan
""".split())


def from_hf_dict(cls, d, *, renames=None, must_be=None):
    """Build config `cls` from a Hugging Face config dict.

    Fields of `cls` are taken by name; `renames` maps other HF spellings to fields; `must_be` maps
    keys whose only supported value is fixed. Any other unknown key raises, so nothing a checkpoint
    asks for is silently ignored.
    """
    # Every family here ties its head to the embedding: an untied checkpoint must not load as tied.
    renames, must_be = renames or {}, {"tie_word_embeddings": True, **(must_be or {})}
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs, unknown = {}, []
    for key, value in d.items():
        if key in must_be:
            if value != must_be[key] and value is not None:
                raise ValueError(f"{cls.__name__}: {key}={value!r} is not supported (expected {must_be[key]!r})")
        elif key in fields or key in renames:
            kwargs[renames.get(key, key)] = value
        elif key not in HF_BOOKKEEPING:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown config fields {sorted(unknown)}")
    return cls(**kwargs)
