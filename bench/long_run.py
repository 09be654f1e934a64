"""Long runs: does memory stay flat over many `generate` calls of changing shape and options?

    python bench/long_run.py [--calls 1000] [--every 20] [--model tiny|gemma3-270m] [--threads N]
                             [--steer-each-call]

Runs `--calls` consecutive `generate` calls in one process. Each draws a batch size (1..8), prompt
lengths, max_new_tokens, a sampler (greedy, random, top-k, top-p, min-p, beam search), sometimes
stop strings and a repetition penalty, and runs the model or a steered copy of it with one strength
per row (`inputs={"steer_strength": ...}`); `--steer-each-call` builds that steered copy anew for
each steered call (`lm.steer(...)`, as a server steering per request might). Every `--every` calls
it records the current RSS (/proc/self/statm), the peak RSS, the bytes of the caches the models
keep between calls, the number of Python objects and the kB of generated source torch.fx keeps
(one entry per traced or recompiled graph, never freed); it prints that curve and the growth from call calls/10 (when every
shape has been seen once) to the last. A leak shows as steady growth per call; a bounded pool
(one kept cache per batch size) shows as early growth that stops.

The default model is a tiny random Gemma 3 built in-process (a character-level tokenizer, no
download); `--model gemma3-270m` runs the real one (use fewer calls: ~2 s a call on 2 cores).
"""
import argparse
import gc
import os
import random
import resource
import string
import sys
import time

import torch

import kvwire as kw

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

WORDS = ("the river city old bridge stone market light night boat children spring race town mill "
         "history began small island grew great world people lived worked square railway").split()
STOPS = (".", "the", "\n", "e ")
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb():
    """(current, peak) resident set size in MB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * PAGE / 1e6
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


def tiny_model():
    """A random 4-layer Gemma 3 (hidden 32, sliding window 4) with a character-level tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvwire.io.tokenizer import Tokenizer as KvTokenizer

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              sliding_window_pattern=2, query_pre_attn_scalar=8, max_position_embeddings=256,
                              bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that sampled tokens vary
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.2)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    lm = kw.from_hf(model)
    lm.tokenizer = KvTokenizer(backend, bos_token_id=2, eos_token_ids=[1], add_bos=True)
    return lm


def steered_copy(lm, seed=0):
    """`lm` steered after every block but the first by a random direction (strength per row)."""
    g = torch.Generator().manual_seed(seed)
    width, blocks = lm.head.weight.shape[1], len(kw.block_calls(lm.backbone))
    vec = kw.ControlVector({i: torch.randn(width, generator=g) * 0.5 for i in range(1, blocks)})
    return lm.steer(vec, 1.0)


def draw_call(rng, max_words, max_new):
    """Keyword arguments of one `generate` call, and a label saying which kind it is."""
    batch = rng.randint(1, 8)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(batch)]
    samplers = [("greedy", kw.Greedy()), ("random", kw.Random(temperature=0.9)), ("top-k", kw.TopK(k=20)),
                ("top-p", kw.TopP(p=0.9)), ("min-p", kw.MinP(p=0.05)), ("beam", kw.BeamSearch(num_beams=3))]
    label, sampler = rng.choice(samplers)
    call = {"prompt": prompts, "max_new_tokens": rng.randint(1, max_new), "sampler": sampler,
            "seed": rng.randrange(1 << 30)}
    if label != "beam" and rng.random() < 0.3:
        call["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.2:
        call["repetition_penalty"] = 1.3
    steered = rng.random() < 0.3
    if steered:
        call["inputs"] = {"steer_strength": torch.tensor([rng.uniform(0.0, 2.0) for _ in range(batch)])}
    return call, label + (" steered" if steered else "")


def fx_source_kb():
    """kB of generated forward code torch.fx keeps for tracebacks (its private eval cache)."""
    from kvwire.graph.release import kept_source_bytes

    return kept_source_bytes() / 1e3


def kept_cache_mb(*lms):
    """MB of the caches the models keep for their next calls (one per batch size)."""
    return sum(lm.pool.nbytes() for lm in lms) / 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=["tiny", "gemma3-270m"])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--threads", type=int, help="default: 1 for tiny (its matmuls are too small to "
                   "share; two threads on a busy 2-core machine made calls ~7x slower), 2 for gemma3-270m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steer-each-call", action="store_true", help="a new lm.steer(...) copy for every steered call")
    args = p.parse_args()
    args.threads = args.threads or (1 if args.model == "tiny" else 2)
    torch.set_num_threads(args.threads)
    print(header(args.threads), flush=True)
    start = time.perf_counter()
    lm = tiny_model() if args.model == "tiny" else kw.load(args.model, progress=False)
    steered = steered_copy(lm)
    max_words, max_new = (12, 32) if args.model == "tiny" else (10, 12)
    rng = random.Random(args.seed)
    print(f"{args.model} loaded in {time.perf_counter() - start:.1f} s; {args.calls} calls, batch 1-8, "
          f"prompts 1-{max_words} words, 1-{max_new} new tokens", flush=True)
    print(f"{'call':>6}{'RSS MB':>10}{'peak MB':>10}{'kept caches MB':>16}{'objects':>10}{'fx code kB':>12}{'s/call':>8}", flush=True)
    kinds, curve = {}, []
    try:
        run(lm, steered, rng, args, max_words, max_new, kinds, curve)
    except KeyboardInterrupt:  # a long run stopped by hand still gets its verdict
        print(f"interrupted after call {curve[-1][0] if curve else 0}")
    print("calls by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    print(f"kept caches at the end: batch sizes {lm.pool.batch_sizes()} (model), {steered.pool.batch_sizes()} (steered)")
    if len(curve) > 1:
        print(verdict(curve, args.calls))


def run(lm, steered, rng, args, max_words, max_new, kinds, curve):
    """The calls; appends (call index, RSS MB, peak MB) to `curve` every `args.every` calls."""
    last = time.perf_counter()
    for index in range(1, args.calls + 1):
        call, kind = draw_call(rng, max_words, max_new)
        if "inputs" in call and args.steer_each_call:
            steered = steered_copy(lm, seed=index)
        (steered if "inputs" in call else lm).generate(**call)
        kinds[kind] = kinds.get(kind, 0) + 1
        if index % args.every == 0 or index == 1:
            current, peak = rss_mb()
            now = time.perf_counter()
            per_call = (now - last) / (args.every if index > 1 else 1)
            curve.append((index, current, peak))
            print(f"{index:6d}{current:10.1f}{peak:10.1f}{kept_cache_mb(lm, steered):16.2f}"
                  f"{len(gc.get_objects()):10d}{fx_source_kb():12.1f}{per_call:8.3f}", flush=True)
            last = now


def verdict(curve, calls):
    """RSS growth from the sample nearest call calls/10 to the last sample."""
    base = min(curve, key=lambda c: abs(c[0] - calls // 10))
    end = curve[-1]
    growth = end[1] - base[1]
    return (f"verdict: RSS {base[1]:.1f} MB at call {base[0]} -> {end[1]:.1f} MB at call {end[0]}: "
            f"{growth:+.1f} MB ({growth / base[1]:+.1%}, {growth * 1e3 / max(1, end[0] - base[0]):+.1f} kB/call); "
            f"peak {end[2]:.1f} MB")

if __name__ == "__main__":
    main()
