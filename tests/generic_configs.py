"""Tiny random transformers models of every decoder-only causal LM type transformers ships, for the
generic path (`kvwire.models.generic`): `decoder_types()` lists them, `tiny_model(model_type)`
builds one.

A tiny config is the type's own config class with the small sizes below applied to whichever of
their fields it has (transformers' spellings differ: `hidden_size`, `n_embd`, `d_model`, ...), plus
a short table of per-type fields where a default does not fit the small sizes. Weight matrices are
spread (as `tiny_models.spread` does) so that tokens differ and attention is far from uniform;
vectors (norm weights, biases, state-space decay terms, sinks) keep transformers' own values.
"""
import dataclasses

import torch

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
# ids the tests draw prompts from: clear of the special ids above and of the multimodal
# placeholders (image/audio/video token ids), which are put at the top of the vocabulary
PROMPT_IDS = (3, 100)

WIDTH, HEADS, KV_HEADS, HEAD = 64, 4, 2, 16
LAYERS = 4
WINDOW = 6
MAX_PARAMETERS = 20_000_000

# field -> value, applied where the config class has the field
SMALL = {
    # width, depth, heads
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "emb_dim", "embedding_dim",
                     "embedding_size", "word_embed_proj_dim", "backbone_hidden_size", "lru_width",
                     "router_hidden_size"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "swa_num_attention_heads", "attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "swa_num_key_value_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "swa_head_dim", "kv_channels", "d_head", "attention_head_dim", "dim_head",
                     "attention_head_size"), HEAD),
    # feed-forward
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "dff", "dim_ff", "ffn_hidden_size",
                     "decoder_ffn_dim", "feed_forward_size", "intermediate_size_mlp", "d_inner",
                     "prefix_dense_intermediate_size", "first_dense_intermediate_size", "dense_intermediate_size",
                     "mlp_only_intermediate_size"), 64),
    # mixture of experts: 4 experts, 2 per token, small experts, one shared expert where there are some
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts"), 2),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
                     "expert_ffn_hidden_size"), 32),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1,  # layer 0 dense, the others mixtures
    # multi-head latent attention
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 32),
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    # sparse-attention indexers
    **dict.fromkeys(("index_n_heads", "indexer_n_heads", "index_num_heads"), 8),  # few ReLU-score ties
    **dict.fromkeys(("index_head_dim", "indexer_head_dim"), 16),
    "index_topk": 4,  # fewer keys than a probe has: the indexer's choice matters
    # linear attention / gated delta-nets
    **dict.fromkeys(("linear_num_key_heads", "linear_num_heads"), 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    # state-space layers: d_inner = expand * width = heads * head size
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim"), 16),
    **dict.fromkeys(("mamba_n_groups", "n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("mamba_expand", "expand"), 1),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 8),
    # positions, windows, chunks
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length"), 256),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_chunk_size", "attention_window_size",
                     "window_size", "local_attention_window_len"), WINDOW),
    "sliding_window_pattern": 2,
    # hybrids: attention every other layer, experts every other layer
    **dict.fromkeys(("attn_layer_period", "expert_layer_period"), 2),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset"), 1),
    # multi-token-prediction heads are not part of the causal LM's forward
    **dict.fromkeys(("num_mtp_layers", "num_nextn_predict_layers"), 0),
    # vocabulary and its special ids
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size"), VOCAB),
    "pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS,
}

# Per-type fields where a default does not fit the sizes above (transformers' own spelling); a
# dict value for a sub-config (text_config, ...) is merged into that sub-config's small fields.
_HYBRID = ["linear_attention", "hybrid", "linear_attention", "hybrid"]
_CONV = ["conv", "full_attention", "conv", "full_attention"]
_DOTS3 = dict(swa_num_attention_heads=HEADS, swa_num_key_value_heads=HEADS, swa_q_lora_rank=32, swa_kv_lora_rank=32,
              swa_head_dim=24, swa_qk_nope_head_dim=16, swa_v_head_dim=16)
OVERRIDES = {
    "blt": dict(encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3, 4],
                local_attention_window_len=WINDOW,
                **{name: dict(hidden_size_global=WIDTH) for name in ("encoder_config", "decoder_config")}),
    "codegen": dict(rotary_dim=8),  # rotary over part of each head
    "kolibri1_1": dict(index_num_heads=2),  # at most the query heads a key head serves
    "gptj": dict(rotary_dim=8),
    # transformers' default attention config has no rope_theta and no clip_qkv, which DBRX's attention reads
    "dbrx": dict(attn_config=dict(kv_n_heads=KV_HEADS, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_top_k=2, ffn_hidden_size=32)),
    "cohere_compass_text": dict(rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for kind in ("full_attention", "sliding_attention")}),
    "dots3_note_text": _DOTS3,  # Dots3's sliding layers take their own latent-attention sizes
    # its vision tower's default per-layer settings name layers 25-41
    "dots3_note": dict(text_config=_DOTS3,
                       vision_config=dict(per_layer_config={}, adapter_in_dim=WIDTH, adapter_out_dim=WIDTH),
                       audio_config=dict(adapter_out_dim=WIDTH, adapter_input_size=WIDTH, downsample_hidden_size=WIDTH,
                                         head_dim=16)),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16),
    # transformers' xLSTM cache sizes its states by the width times qk_dim_factor rounded up to 64,
    # its layers by that product itself: they agree (and its cached forward runs) at multiples of 64
    "xlstm": dict(qk_dim_factor=1.0),
    # per-layer embeddings: a (vocabulary, layers * width) table
    "gemma3n_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                         layer_types=["sliding_attention", "full_attention"] * 2, intermediate_size=[64] * LAYERS,
                         activation_sparsity_pattern=[0.0] * LAYERS),
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=32),
    "gemma4": dict(text_config=dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                                    global_head_dim=32)),
    "gemma3": dict(vision_config=dict(model_type="siglip_vision_model", image_size=28, patch_size=14),
                   mm_tokens_per_image=4),
    "gemma4_unified": dict(vision_config=dict(mm_embed_dim=WIDTH, output_proj_dims=WIDTH, mm_posemb_size=16),
                           text_config=dict(global_head_dim=32)),
    "gpt_neo": dict(attention_types=[[["global", "local"], LAYERS // 2]], window_size=WINDOW),
    "lfm2": dict(full_attn_idxs=[1, 3]),  # LFM2's short-convolution layers between attention layers
    "lfm2_moe": dict(layer_types=_CONV, num_dense_layers=1),
    "lfm3": dict(layer_types=_CONV),
    # rotary tables are head_dim wide and cover the latent attention's rotary part
    "longcat_flash": dict(head_dim=8, zero_expert_num=2),
    "qwen4_exp_text": dict(indexer_kv_heads=1, indexer_budget=8, indexer_compress_ratio=2),
    "qwen4_exp": dict(text_config=dict(indexer_kv_heads=1, indexer_budget=8, indexer_compress_ratio=2)),
    "zamba": dict(layers_block_type=_HYBRID),
    # Zamba2's Mamba clamps dt to time_step_min in its chunked scan but not in its one-token step, so
    # transformers' own cached decoding leaves its forward wherever dt falls below it: a floor it never meets
    "zamba2": dict(layers_block_type=_HYBRID, time_step_min=1e-9),
    "zaya": dict(num_experts_per_tok=1),
}

# Left out by name, where no rule of `decoder_types` catches them: an encoder's head used as a
# decoder (bidirectional unless configured `is_decoder`), and draft models that need a target model.
EXCLUDED = {
    "bert-generation": "an encoder (BERT) used as a decoder; its attention is bidirectional unless is_decoder",
    "gemma4_assistant": "a draft model for assisted decoding: its forward takes the target model's key/value states",
    "gemma4_unified_assistant": "a draft model for assisted decoding: its forward takes the target model's key/value "
                                "states",
}


def decoder_types():
    """Every model_type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES that is a decoder-only
    language model, sorted. Left out by rule: encoder-decoder configs (`is_encoder_decoder`) and
    types that are also masked-LM encoders (transformers' MODEL_FOR_MASKED_LM_MAPPING_NAMES: BERT,
    RoBERTa, ... whose causal-LM head is the encoder run as a decoder); by name: `EXCLUDED`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    kept = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in EXCLUDED:
            continue
        if _is_encoder_decoder(CONFIG_MAPPING[model_type]):
            continue
        kept.append(model_type)
    return sorted(kept)


def _is_encoder_decoder(config_class):
    try:
        return config_class().is_encoder_decoder  # some set it while initialising
    except Exception:  # noqa: BLE001 - a default config that does not validate: the field's default
        return bool(getattr(config_class, "is_encoder_decoder", False))


def tiny_config(model_type, **fields):
    """The type's config class with `SMALL` applied to the fields it has (and to those of its
    sub-configs: text, vision, audio), then `OVERRIDES`, then `fields` (e.g. fewer layers)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    return config_class(**_settings(config_class, {**OVERRIDES.get(model_type, {}), **fields}))


def _settings(config_class, overrides):
    fields = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    settings = {k: v for k, v in SMALL.items() if k in fields}
    settings.update(_special_ids(fields))
    if "kv_lora_rank" in fields:  # latent attention expands keys and values per query head
        settings["num_key_value_heads"] = HEADS
    for name, sub in getattr(config_class, "sub_configs", {}).items():
        sub_overrides = overrides.get(name, {})
        if not dataclasses.is_dataclass(sub) and "model_type" not in sub_overrides:
            # a sub-config of any type (AutoConfig): the type the default config gives it
            sub_overrides = {"model_type": _default_sub_type(config_class, name), **sub_overrides}
        if sub_overrides.get("model_type"):
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            sub = CONFIG_MAPPING[sub_overrides["model_type"]]
        if name in fields and dataclasses.is_dataclass(sub):
            settings[name] = _settings(sub, sub_overrides)
    settings.update({k: v for k, v in overrides.items() if k not in settings or not isinstance(settings[k], dict)})
    if overrides.get("model_type"):
        settings["model_type"] = overrides["model_type"]
    return settings


def _default_sub_type(config_class, name):
    try:
        return getattr(getattr(config_class(), name, None), "model_type", None)
    except Exception:  # noqa: BLE001 - a default config that does not validate
        return None


def _special_ids(fields):
    """Every other *_token_id / *_token_index field at the top of the vocabulary."""
    names = sorted(f for f in fields if (f.endswith("_token_id") or f.endswith("_token_index"))
                   and f not in ("pad_token_id", "bos_token_id", "eos_token_id"))
    return {name: VOCAB - 1 - i for i, name in enumerate(names)}


def tiny_model(model_type, seed=0, **fields):
    """A tiny random transformers causal LM of `model_type`: float32, eval mode, eager attention
    (`fields`: config fields set last, e.g. two layers where a test compiles)."""
    import transformers

    config = tiny_config(model_type, **fields)
    config._attn_implementation = "eager"
    with torch.device("meta"):  # a default left large (a vocabulary, a vision tower) fails here, not by memory
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny {model_type} config still has {size / 1e6:.1f}M parameters")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    spread(model, seed)
    return model


def spread(model, seed=0):
    """Weight matrices large enough that tokens differ and attention is far from uniform; vectors
    keep their initial values (norm weights, biases, decay terms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1 and p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def prompt(batch, length, seed):
    """(batch, length) random prompt ids in PROMPT_IDS."""
    return torch.randint(*PROMPT_IDS, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids):
    """transformers' uncached logits (B, T, V)."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def rollout(logits_of, ids, steps):
    """Greedy tokens (B, steps) from uncached forwards of the whole sequence at every step:
    `logits_of(ids) -> (B, T, V)` is transformers' model or a kvwire model called plainly."""
    x = ids
    with torch.no_grad():
        for _ in range(steps):
            x = torch.cat([x, logits_of(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[:, ids.shape[1]:]


TIE = 1e-5


def cast_tokens_agree(lm, hf, dtype, lengths, n=8, seed=3):
    """Whether `lm` cast to `dtype` after its build greedily decodes what transformers' own `generate`
    of `hf` (the same weights, cast too) does, for random rows of `lengths`."""
    import torch

    lm, hf = lm.to(dtype), hf.to(dtype)
    g = torch.Generator().manual_seed(seed)
    for row in (torch.randint(*PROMPT_IDS, (length,), generator=g) for length in lengths):
        with torch.no_grad():
            theirs = hf.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(row):]
        if lm.generate(row, max_new_tokens=n, ignore_eos=True).tolist() != theirs.tolist():
            return False
    return True


def greedy_disagreements(logits_of, ids, tokens):
    """Where cached greedy `tokens` (B, N) are not the uncached argmax, teacher-forced: [(row,
    step, chosen, best, gap)] for every step whose chosen token is more than TIE below the best
    logit. Empty when `tokens` equal the uncached rollout, or differ from it only at near ties (a
    free-running rollout repeats a tie's flip in every later token, so the comparison follows
    `tokens`)."""
    with torch.no_grad():
        logits = logits_of(torch.cat([ids, tokens], dim=1))[:, ids.shape[1] - 1:-1].float()
    bad = []
    for row in range(tokens.shape[0]):
        for step in range(tokens.shape[1]):
            chosen, best = int(tokens[row, step]), int(logits[row, step].argmax())
            gap = float(logits[row, step, best] - logits[row, step, chosen])
            if gap > TIE:
                bad.append((row, step, chosen, best, gap))
    return bad


def rows_joining_a_batch(lm, lengths, budgets, *, max_length, prefill_chunk, seed, head_start=3):
    """Rows of `lengths` random prompt tokens through one engine (max_batch 2): the first decodes
    `head_start` steps alone, then the others join, prefilled `prefill_chunk` tokens a step, taking
    rows others left. Each row's tokens and log-probs must equal its own `lm.generate`; returns the
    engine (its stats)."""
    from kvwire.generate import Engine

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(*PROMPT_IDS, (n,), generator=g).tolist() for n in lengths]
    engine = Engine(lm, max_batch=2, max_length=max_length, prefill_chunk=prefill_chunk)
    first = engine.submit(rows[0], budgets[0])
    for i, _ in enumerate(engine.run([first])):
        if i >= head_start - 1:
            break
    seqs = [first] + [engine.submit(r, n) for r, n in zip(rows[1:], budgets[1:])]
    for _ in engine.run(seqs):
        pass
    for seq, row, n in zip(seqs, rows, budgets):
        alone = lm.generate(torch.tensor(row), max_new_tokens=n, ignore_eos=True, return_logprobs=True)
        assert seq.tokens == alone.tokens[0]
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(alone.logprobs[0]), atol=1e-4, rtol=1e-4)
    return engine
