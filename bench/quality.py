"""What reduced precision costs in quality: greedy agreement with float32 and perplexity change.

    python bench/quality.py [--variants bfloat16 bfloat16+int8 bfloat16+int4 float32+gguf
                             float32+gguf+head=q5_0] [--new-tokens 48]

For each variant ("dtype[+scheme][+head=Q]", as in bench/generate.py) the default model greedily
continues the prompts below; reported: the share of generated tokens equal to float32's (position
by position), how many tokens stay identical before the first difference (mean over prompts), and
the perplexity of the passage below against float32's. ggml variants score the passage through
their decode kernels (8-bit activations, as every decode step runs), not the float GEMM their
many-row calls take, so the perplexity shows what decoding costs.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import header, load_variant  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "To make a good cup of tea, you should",
    "The three laws of motion state that",
    "def fibonacci(n):",
    "The most important thing about learning a language is",
]

PASSAGE = (
    "The river runs through the middle of the old town, and for centuries it decided where people "
    "lived and worked. Mills stood along its banks, turning grain into flour for the markets in the "
    "square. When the railway arrived, the mills closed one by one, and the buildings were turned into "
    "shops, schools and, later, small museums. Today most visitors come for the bridges: there are "
    "eleven of them within a short walk, each built in a different century and each with a story. The "
    "oldest is made of grey stone and is too narrow for cars; the newest is a light steel arch that "
    "opens at night for the boats that still carry goods upstream. Local children learn the names of "
    "all eleven before they can read, and every spring the town holds a race that crosses each bridge "
    "once, in order, from the oldest to the newest."
)


def greedy(lm, new_tokens):
    return [lm.generate(p, max_new_tokens=new_tokens, ignore_eos=True, return_logprobs=True).tokens[0]
            for p in PROMPTS]


def agreement(rows, reference):
    same = sum(a == b for row, ref in zip(rows, reference) for a, b in zip(row, ref))
    prefix = []
    for row, ref in zip(rows, reference):
        n = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), len(ref))
        prefix.append(n)
    return same / sum(len(r) for r in reference), sum(prefix) / len(prefix)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=["bfloat16", "bfloat16+int8", "bfloat16+int4", "float32+gguf",
                                                     "float32+gguf+head=q5_0"])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(header(args.threads), flush=True)
    try:
        from kvwire.quant.ggml import linear as ggml_linear
        ggml_linear.MANY_ROWS = 1 << 30  # every call through the decode kernels
    except ImportError:
        pass
    reference = load_variant("float32")
    ref_tokens, ref_ppl = greedy(reference, args.new_tokens), reference.perplexity(PASSAGE)
    del reference
    print(f"{'variant':26}{'same tokens':>13}{'same prefix':>13}{'perplexity':>12}{'change':>9}")
    print(f"{'float32':26}{1.0:13.3f}{args.new_tokens:13.1f}{ref_ppl:12.3f}{0.0:+9.2%}")
    for variant in args.variants:
        lm = load_variant(variant)
        share, prefix = agreement(greedy(lm, args.new_tokens), ref_tokens)
        ppl = lm.perplexity(PASSAGE)
        print(f"{variant:26}{share:13.3f}{prefix:13.1f}{ppl:12.3f}{ppl / ref_ppl - 1:+9.2%}")
        del lm
    print(f"{len(PROMPTS)} prompts x {args.new_tokens} greedy tokens; same prefix = tokens before the "
          "first difference (mean); perplexity of a 9-sentence passage")


if __name__ == "__main__":
    main()
