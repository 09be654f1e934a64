"""Eager decode on ggml blocks with a layer's sibling projections (q/k/v, gate/up) in one
`kvwire::ggml_matmuls` call (`kernels.products.siblings`) against one call per projection, the two
alternating in one process so that a drifting machine weighs on both alike.

    python bench/siblings.py [--model smollm2-135m-instruct] [--threads 1 2] [--rounds 6] [--new 48]

Per thread count: each round times `--new` greedy tokens after a short prompt, best of 3, once each
way; the medians and their ratio are printed.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402


def rate(lm, new, texts):
    """Best of 3 decode rates (tokens/s) of `new` greedy tokens; the text each gave joins `texts`."""
    best = 0.0
    for _ in range(3):
        gen = lm.generate("The capital of France is", max_new_tokens=new, ignore_eos=True, return_logprobs=True)
        best = max(best, gen.decode_steps / gen.decode_seconds)
        texts.add(gen.texts[0])
    return best


def main(argv=None):
    import kvwire as kw
    from kvwire.kernels import products

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--new", type=int, default=48)
    args = p.parse_args(argv)
    lm = kw.load(args.model, quantize="gguf", progress=False)
    fusable = products._fusable
    apart = lambda x, modules: None  # noqa: E731 - every projection its own call
    print(header("/".join(map(str, args.threads))))
    print(f"{args.model}, eager on ggml blocks, {args.new} new tokens; tokens/s per round")
    texts, ratios = set(), {}
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            rate(lm, args.new, texts)  # warm-up
            rows = {"one call": [], "apart": []}
            for _ in range(args.rounds):
                for name, fn in (("one call", fusable), ("apart", apart)):
                    products._fusable = fn
                    rows[name].append(rate(lm, args.new, texts))
            products._fusable = fusable
            medians = {name: statistics.median(v) for name, v in rows.items()}
            for name, values in rows.items():
                print(f"{threads} threads {name:9} {' '.join(f'{v:6.1f}' for v in values)}  median {medians[name]:6.1f}")
            ratios[threads] = medians["one call"] / medians["apart"]
            print(f"{threads} threads one call / apart: {ratios[threads]:.2f}x")
    finally:
        products._fusable = fusable
    if len(texts) != 1:  # the two ways compute the same numbers: greedy text cannot differ
        raise SystemExit(f"the two ways gave different text: {sorted(texts)}")
    return ratios


if __name__ == "__main__":
    main()
