"""Steer the default model (Gemma 3 270M) from sad to happy with a control vector.

Trains a vector on the 36 paired prompts in examples/data/{happy,sad}.txt, then for strengths
-k..+k measures the mean log-probability of held-out happy and sad words after neutral prompts
(none of these words or prompts is in the training pairs) and prints greedy samples.

    python examples/steer_demo.py [--layers 3-12] [--method pca_center] [--out happy.gguf]
"""
import argparse
import time
from pathlib import Path

import torch

import kvwire as kw
from kvwire.steer.measure import word_logprob

DATA = Path(__file__).parent / "data"
PROMPTS = ["I think that today is", "When I opened the door, I felt", "The weather this morning was",
           "Honestly, my week has been", "Looking at the letter, she felt"]
HAPPY = [" happy", " wonderful", " great", " joy", " love", " beautiful", " excited", " amazing"]
SAD = [" sad", " terrible", " awful", " angry", " miserable", " lonely", " horrible", " upset"]
STRENGTHS = [-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0]


def pairs():
    happy = (DATA / "happy.txt").read_text().splitlines()
    sad = (DATA / "sad.txt").read_text().splitlines()
    return happy, sad


def effect(lm, vec, strengths=STRENGTHS):
    """[(strength, mean log p(happy words), mean log p(sad words))] over the held-out prompts."""
    rows = []
    for s in strengths:
        steered = lm.steer(vec, s)
        rows.append((s, word_logprob(steered, PROMPTS, HAPPY), word_logprob(steered, PROMPTS, SAD)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="3-12")
    p.add_argument("--method", default="pca_center")
    p.add_argument("--out", default=None, help="also save the vector (llama.cpp GGUF)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    lm = kw.load("gemma3-270m")
    happy, sad = pairs()
    start = time.perf_counter()
    vec = kw.ControlVector.train(lm, happy, sad, layers=args.layers, method=args.method)
    print(f"trained on {len(happy)} pairs, blocks {args.layers}, {args.method}: "
          f"{time.perf_counter() - start:.1f} s\n")
    if args.out:
        vec.save(args.out)
    print("| strength | mean log p(happy words) | mean log p(sad words) | happy - sad |")
    print("|---:|---:|---:|---:|")
    for s, h, d in effect(lm, vec):
        print(f"| {s:+.2f} | {h:.2f} | {d:.2f} | {h - d:+.2f} |")
    prompts = ["I think that today is", "My week has been"]
    print()
    for s in STRENGTHS:
        texts = lm.steer(vec, s).generate(prompts, max_new_tokens=24)
        for prompt, text in zip(prompts, texts):
            print(f"{s:+.2f} | {prompt}{text!r}"[:160])


if __name__ == "__main__":
    main()
