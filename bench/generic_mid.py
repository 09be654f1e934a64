"""The generic path on mid-size random models of families kvwire has no native decoder for: a Mamba-2
hybrid (Bamba: Mamba-2 layers with attention every other layer) and a mixture of experts
(Qwen3-MoE), each 8 layers x 512 wide, against transformers' own `generate` on the same weights;
`--types recurrent_gemma` adds RecurrentGemma (RG-LRU state kept in module attributes, local
attention every third layer).

    python bench/generic_mid.py [--types bamba,qwen3_moe] [--threads 2] [--new 64] [--rounds 3]

Per type: decode tokens/s at batch 1 (greedy, `--new` tokens after a 32-token prompt; the best of
`--rounds`, kvwire and transformers taking turns) and their ratio; that both produced the same
tokens; and the cache's bytes per row at 256 and 4096 positions, split into the attention layers'
keys/values (which grow with the timeline) and the recurrent layers' state slots (which must not).
Random weights: the speed and memory of the architecture, not of a checkpoint.
"""
import argparse
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, ROOT)
from common import header  # noqa: E402

WIDTH, LAYERS, HEADS, KV_HEADS, HEAD = 512, 8, 8, 2, 64
# the tests' tiny sizes (tests/generic_configs.SMALL) scaled to a model that is small but not a toy
MID = {"hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
       "num_key_value_heads": KV_HEADS, "head_dim": HEAD, "intermediate_size": 2 * WIDTH,
       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH // 2,
       "mamba_n_heads": HEADS, "mamba_d_head": HEAD, "mamba_expand": 1, "mamba_d_state": 64,
       "mamba_n_groups": 1, "mamba_chunk_size": 64, "vocab_size": 32000, "max_position_embeddings": 8192,
       "lru_width": WIDTH, "attention_window_size": 2048}


def mid_model(model_type):
    """A random float32 transformers model of `model_type` at the MID sizes (over the tests' tiny
    config, so every other field keeps a value that fits)."""
    import torch
    import transformers

    import dataclasses

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.generic_configs import OVERRIDES, _settings, spread

    config_class = CONFIG_MAPPING[model_type]
    fields = {f.name for f in dataclasses.fields(config_class)}
    settings = _settings(config_class, OVERRIDES.get(model_type, {}))
    settings.update({name: value for name, value in MID.items() if name in fields})
    if "attn_layer_indices" in fields:  # attention every other layer
        settings["attn_layer_indices"] = list(range(1, LAYERS, 2))
    config = config_class(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    spread(model, 0)
    return model


def hf_decode(model, ids, new):
    """(tokens/s, tokens) of transformers' own greedy generate (its cache), decode only."""
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        total = time.perf_counter() - start
    return (new - 1) / max(total - first, 1e-9), out[0, ids.shape[1]:].tolist()


def kw_decode(lm, ids, new):
    """(tokens/s, tokens) of kvwire's generate, decode only (its record's timings)."""
    record = lm.generate_ids([ids[0]], max_new_tokens=new, ignore_eos=True)
    return record.decode_tokens_per_second, list(record.tokens[0])


def cache_split(lm, length):
    """(attention bytes, state bytes) of one row's cache at `length` positions."""
    from kvwire.serve.memory import slot_bytes

    attention = state = 0
    for slot in lm.cached.slots:
        n = slot_bytes(slot, 1, length)
        if slot.name.endswith(".state") or getattr(slot.module, "calls", None) == []:  # a state slot
            state += n
        else:
            attention += n
    return attention, state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="bamba,qwen3_moe")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    import kvwire as kw

    torch.set_num_threads(args.threads)
    print(header(args.threads))
    print(f"random weights, {LAYERS} layers x {WIDTH} wide, float32; decode at batch 1 after a 32-token prompt, "
          f"{args.new} new tokens, best of {args.rounds}")
    print(f"{'type':<12} {'params':>7} {'kvwire tok/s':>13} {'hf tok/s':>9} {'ratio':>6} {'same tokens':>11} "
          f"{'KV B/row @256':>14} {'@4096':>10} {'state B/row @256':>17} {'@4096':>10}")
    out = {}
    for model_type in args.types.split(","):
        original = mid_model(model_type)
        hf = copy.deepcopy(original)
        lm = kw.from_hf(original, generic=True)
        params = sum(p.numel() for p in hf.parameters()) / 1e6
        ids = torch.randint(3, 30000, (1, 32), generator=torch.Generator().manual_seed(1))
        best_kw = best_hf = 0.0
        for _ in range(args.rounds):
            rate_kw, tokens_kw = kw_decode(lm, ids, args.new)
            rate_hf, tokens_hf = hf_decode(hf, ids, args.new)
            best_kw, best_hf = max(best_kw, rate_kw), max(best_hf, rate_hf)
        same = tokens_kw[-args.new:] == tokens_hf
        kv256, st256 = cache_split(lm, 256)
        kv4k, st4k = cache_split(lm, 4096)
        out[model_type] = (best_kw, best_hf, same, (kv256, kv4k), (st256, st4k))
        print(f"{model_type:<12} {params:>6.0f}M {best_kw:>13.1f} {best_hf:>9.1f} {best_kw / best_hf:>6.2f} "
              f"{str(same):>11} {kv256:>14,} {kv4k:>10,} {st256:>17,} {st4k:>10,}", flush=True)
    return out


if __name__ == "__main__":
    main()
