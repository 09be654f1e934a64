"""Which Inductor options make `lm.compile()`'s decode step faster? Variants compared in one process.

    python bench/compile_options.py '{}' '{"size_asserts": true}' [--model smollm2-135m-instruct]
                                    [--quantize gguf] [--tokens 40] [--rounds 8] [--threads 2]

Each argument is a JSON dict of Inductor options passed as `lm.compile(options=...)` (on top of
kvwire's own: `{}` is what `lm.compile()` runs); the key `"kvwire_dynamo": true` (not an Inductor
option) compiles with `backend="inductor"` spelled out, so every step goes through dynamo instead of
calling Inductor's function directly (kvwire/generate/direct.py). Every variant is its own model, compiled once (decode
steps only: `prefill_tokens=0`), then the variants generate in turn for `--rounds` rounds; a token's
time is (generate n+1 tokens - generate 1 token) / n, best round of each. Timing noise between
processes here reaches +-20%, so only ratios within this one run mean anything.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

PROMPT = "The capital of France is"


def token_ms(lm, tokens):
    start = time.perf_counter()
    lm.generate(PROMPT, max_new_tokens=1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    lm.generate(PROMPT, max_new_tokens=tokens + 1)
    return (time.perf_counter() - start - one) / tokens * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="+", type=json.loads, help="JSON dicts of Inductor options")
    p.add_argument("--model", default="smollm2-135m-instruct", choices=["gemma3-270m", "smollm2-135m-instruct"])
    p.add_argument("--quantize", default="gguf")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import kvwire as kw

    torch.set_num_threads(args.threads)
    print(header(args.threads), flush=True)
    models = []
    for options in args.variants:
        inductor = {k: v for k, v in options.items() if k != "kvwire_dynamo"}
        extra = {"backend": "inductor"} if options.get("kvwire_dynamo") else {}
        lm = kw.load(args.model, quantize=args.quantize, progress=False).compile(prefill_tokens=0, options=inductor,
                                                                                 **extra)
        start = time.perf_counter()
        lm.generate(PROMPT, max_new_tokens=2)
        print(f"{json.dumps(options)}: first call (compiles or reads Inductor's cache) {time.perf_counter() - start:.1f} s",
              flush=True)
        models.append(lm)
    best = [float("inf")] * len(models)
    for _ in range(args.rounds):
        for i, lm in enumerate(models):
            best[i] = min(best[i], token_ms(lm, args.tokens))
    for options, ms in zip(args.variants, best):
        print(f"{json.dumps(options):60s} {ms:7.3f} ms/token  {best[0] / ms:5.2f}x the first")


if __name__ == "__main__":
    main()
