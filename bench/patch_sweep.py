"""What sharing the blocks below each patch saves in an activation-patching sweep: SmolLM2, a clean
and a corrupted prompt of the same length, every (site, block, position) patched, in one run.

    python bench/patch_sweep.py [--threads 2] [--sites block_out] [--batch 16] [--tiny]

- whole: every row (one patch each, plus the unpatched row of each batch) runs through the whole
  model (`Patcher(share=False)`);
- shared: kvwire's way (`kw.patch.sweep`): rows run in order of their patched block, and a batch
  starts from the corrupted prompt's states at its lowest patched block, computed for one row.
Both give the same scores (checked). Prints the CPU, both wall times and their ratio.
`--tiny` runs a random 4-layer llama with a character tokenizer.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402
from steer_eval import model  # noqa: E402  (SmolLM2, or a random tiny llama with a character tokenizer)

CLEAN, CORRUPTED = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
ANSWERS = (" Paris", " Rome")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sites", nargs="+", default=["block_out"])
    p.add_argument("--batch", type=int, default=16, help="patch rows a call (default 16)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    import torch

    import kvwire as kw

    torch.set_num_threads(args.threads)
    lm = model(args.tiny)
    clean, corrupted = (CLEAN, CORRUPTED) if not args.tiny else ("ab cat", "ab dog")
    answers = ANSWERS if not args.tiny else ("c", "d")
    if len(lm.encode(clean)) != len(lm.encode(corrupted)):
        raise SystemExit(f"the prompts must have as many tokens: {len(lm.encode(clean))} and "
                         f"{len(lm.encode(corrupted))}")
    print(header(args.threads))
    times, results = {}, {}
    for share in (False, True):
        patcher = kw.patch.Patcher(lm, clean, corrupted, args.sites, None, answers, None, None, share=share)
        positions = patcher.positions(None)
        kw.patch.run(lm, clean, corrupted, [[]], sites=args.sites, answers=answers)  # warm-up
        start = time.perf_counter()
        results[share] = kw.patch.sweep_with(patcher, positions, args.batch)
        times[share] = time.perf_counter() - start
    gap = float((results[False].scores - results[True].scores).abs().max())
    assert gap < 1e-3, gap
    shape = tuple(results[True].scores.shape)
    print(f"{shape[0]} sites x {shape[1]} blocks x {shape[2]} positions = {results[True].scores.numel()} patches, "
          f"{args.batch} a call")
    print(f"whole {times[False]:.2f} s, shared {times[True]:.2f} s: {times[False] / times[True]:.2f}x "
          f"(max |score diff| {gap:.1e})")
    return times


if __name__ == "__main__":
    main()
