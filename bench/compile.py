"""Does `torch.compile` of the decode step pay off? Compile time vs time saved per token.

    python bench/compile.py [--steps 20] [--threads 2] [--dtype float32] [--quantize int8|int4|gguf|q8_0]

Compiles the cached graph + head for T=1 (static shapes) as `lm.compile()` does, then times eager
and compiled decode steps in turn (best of 5 runs of `--steps` steps) and compares the logits
(models whose kernels quantise activations to 8 bits, e.g. --quantize gguf, differ by up to ~1
logit: a 1e-6 change of the input moves their logits that much, eager or compiled).
"""
import argparse
import os
import sys
import time

import torch

import kvwire as kw
from kvwire.generate.compiled import CompiledDecode
from kvwire.layers.shared import per_call

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default=None, help="int8, int4, gguf or a ggml type (q8_0, ...)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(header(args.threads), flush=True)
    lm = kw.load("gemma3-270m", dtype=args.dtype, quantize=args.quantize, progress=False)
    cached, length = lm.cached, args.steps + 4
    graph = cached.graph_module

    def step(token, position, index, mask, cache):
        with per_call():  # as CachedGraph calls it: layers share masks and rotary tables
            hidden, cache = graph(token, position, index, mask, cache)
        return lm.head(hidden[:, -1]), cache

    decode = CompiledDecode(cached, lm.head)  # what lm.compile() runs

    def compiled(token, position, index, mask, cache):
        return decode(token, position, index, mask, cache, ())

    mask = torch.ones(1, length, dtype=torch.bool)
    token = torch.tensor([[5]])
    with torch.inference_mode():
        start = time.time()
        compiled(token, torch.tensor([[0]]), torch.tensor(0), mask, cached.init_cache(1, length))
        compile_s = time.time() - start
        best = {"eager": float("inf"), "compiled": float("inf")}
        for _ in range(5):
            for name, fn in (("eager", step), ("compiled", compiled)):
                cache = cached.init_cache(1, length)
                start = time.perf_counter()
                for i in range(args.steps):
                    logits, cache = fn(token, torch.tensor([[i]]), torch.tensor(i), mask, cache)
                best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
        a, b = cached.init_cache(1, length), cached.init_cache(1, length)
        for i in range(4):
            x, a = step(token, torch.tensor([[i]]), torch.tensor(i), mask, a)
            y, b = compiled(token, torch.tensor([[i]]), torch.tensor(i), mask, b)
    saved = best["eager"] - best["compiled"]
    print(f"{args.dtype} {args.quantize or ''}: compile {compile_s:.1f} s; decode step eager {best['eager'] * 1000:.1f} ms, compiled "
          f"{best['compiled'] * 1000:.1f} ms; max |logit diff| {float((x - y).abs().max()):.2e}")
    if saved > 0:
        print(f"pays off after {compile_s / saved:.0f} generated tokens")
    else:
        print("the compiled step is not faster")


if __name__ == "__main__":
    main()
