"""Prefix hits arriving together: one batched prefill against one prefill per hit, in one run.

    python bench/prefix_burst.py [--model smollm2-135m-instruct] [--quantize gguf] [--clients 8]
                                 [--shared 400] [--rounds 3] [--threads 2]

A conversation of `--shared` tokens is stored in the engine's prefix store; then `--clients`
prompts that extend it by a few to ~25 new tokens each (the package's neutral text) (a shared system prompt and history, each
client's own next message) are submitted at once. Timed: from the submission to the last of them
having its first token (their prefill), the engine's default (the hits batched, `Engine._hits`)
against the hits admitted one per prefill job (the engine without batching, patched in for the
comparison). Best of `--rounds` interleaved rounds; both must give the same first tokens.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402


def one_at_a_time(engine, room):
    """Engine._hits without batching: the queue's first hit alone."""
    seq = engine.waiting[0]
    return [(seq, engine._lookup(seq))]


def burst(lm, shared, extras, batched):
    """Seconds from submitting every prompt to the last one's first token, and the first tokens."""
    from kvwire.generate.engine import Engine
    from kvwire.generate.prefix import PrefixStore

    engine = Engine(lm, max_batch=len(extras), max_length=len(shared) + 64, prefix_store=PrefixStore())
    if not batched:
        engine._hits = lambda room: one_at_a_time(engine, room)
    first = engine.submit(shared, 2)
    for _ in engine.run([first]):
        pass
    base = first.prompt + first.tokens
    start = time.perf_counter()
    seqs = [engine.submit(base + extra, 1) for extra in extras]
    for _ in engine.run(seqs):
        pass
    seconds = time.perf_counter() - start
    assert all(s.cached_tokens > 0 for s in seqs), "every prompt should reuse the stored conversation"
    return seconds, [s.tokens[0] for s in seqs], engine.stats["scratch_prefills"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantize", default="gguf")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--shared", type=int, default=400, help="tokens of the stored conversation")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    import torch

    import kvwire as kw

    if args.threads:
        torch.set_num_threads(args.threads)
    print(header(torch.get_num_threads()))
    lm = kw.load(args.model, progress=False, quantize=None if args.quantize == "none" else args.quantize)
    # real text, whose next tokens are not near-ties as random ids' are (the batched rows recompute
    # part of their prefix, so quantised kernels may round differently there)
    words = kw.steer.neutral_text().split()
    shared = lm.tokenizer.encode(" ".join(words * (1 + args.shared // len(words))))[:args.shared]
    extras = [lm.tokenizer.encode(" " + " ".join(words[7 * i: 7 * i + 3 + (5 * i) % 21]))
              for i in range(args.clients)]
    best = {True: float("inf"), False: float("inf")}
    firsts, jobs = {}, {}
    burst(lm, shared, extras, True)  # warm up
    for _ in range(args.rounds):
        for batched in (False, True):
            seconds, firsts[batched], jobs[batched] = burst(lm, shared, extras, batched)
            best[batched] = min(best[batched], seconds)
    print(f"model: {args.model} ({args.quantize}), a {args.shared}-token stored conversation, {args.clients} "
          f"prompts extending it by {min(map(len, extras))}-{max(map(len, extras))} tokens, submitted at once; "
          f"best of {args.rounds}")
    print(f"one prefill per hit: {best[False]:.3f} s to every first token ({jobs[False]} prefill jobs)")
    print(f"batched (default):   {best[True]:.3f} s ({jobs[True]} prefill jobs)")
    print(f"batched / one per hit: {best[False] / best[True]:.2f}x faster; same first tokens: "
          f"{firsts[True] == firsts[False]}")


if __name__ == "__main__":
    main()
