"""What batching a steering evaluation's strengths as rows saves: SmolLM2, a vector at one block,
`--strengths` strengths x `--examples` A/B examples (the shipped sentiment-ab questions, numbered to
make 64 distinct prompts), in one run.

    python bench/steer_eval.py [--threads 2] [--layers 10 15 20] [--when all generated]
                               [--strengths 16] [--examples 64] [--tiny]

- loop: per strength, `lm.steer(vec, s, when=...)` and one batched call over the examples (the whole
  steered model, left-padded, the head at the answer tokens only);
- rows: kvwire's evaluation path (`Reference.logit_diffs`): the steered model built once, each
  row's strength a runtime input, `--batch` rows a call, and what rows share run once: with the
  vector on every position ("all"), the blocks below the steered one, once per example; with the
  vector on the answer alone ("generated", CAA's convention: the prompt is not steered), the whole
  prompt, once per example, each row then running its answer tokens on a copy of that cache.
Both give the same A/B logit differences (checked). Prints the CPU, both wall times and their ratio
per layer and schedule, and `kw.steer.evaluate`'s own wall time (which adds the side effects on
neutral text). `--tiny` runs a random 4-layer llama with a character tokenizer.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

PRESET = "smollm2-135m-instruct"


def model(tiny):
    import kvwire as kw

    if not tiny:
        return kw.load(PRESET, progress=False)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.conftest import FAMILIES
    from tests.tokenizers_for_tests import char_level

    lm = kw.from_hf(FAMILIES["llama"](vocab_size=100, max_position_embeddings=512))
    lm.tokenizer = char_level()
    return lm


def examples(n):
    import kvwire as kw

    shipped = kw.steer.dataset("sentiment-ab")
    return kw.steer.ABDataset(tuple(_numbered(shipped[i % len(shipped)], i) for i in range(n)), "sentiment-ab x")


def _numbered(example, i):
    from kvwire.steer.dataset import Example

    return Example(f"Question {i + 1}. {example.prompt}", example.positive, example.negative)


def loop(lm, vec, ans, strengths, when):
    """Logit differences (S, N): per strength a freshly steered model, one call over the examples."""
    import torch

    from kvwire.steer.rows import RowRunner
    from kvwire.steer.scoring import answer_logprobs

    out = []
    for s in strengths:
        runner = RowRunner(lm.steer(vec, s, when=when), split=False)
        batch = runner.encode(ans.texts, prompts=ans.prompts)
        which = torch.arange(len(ans.texts))
        score, _, ex = answer_logprobs(lm.head, runner.final(batch, {}, which), which, ans, batch["lengths"])
        out.append(torch.zeros(int(ans.example.max()) + 1, dtype=torch.float64).index_add_(0, ex, score.double()))
    return torch.stack(out)


def rows(reference, vec, strengths, when):
    """Logit differences (S, N) the evaluation's way: one steered model, strengths as rows."""
    from kvwire.steer import Operation

    return reference.logit_diffs(Operation.add(vec, when=when), strengths)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, nargs="+", default=[10, 15, 20])
    p.add_argument("--when", nargs="+", default=["all", "generated"], choices=["all", "generated"],
                   help="the positions steered: every one, or the answer's alone (default both)")
    p.add_argument("--strengths", type=int, default=16)
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="rows a call on the rows path (default 64)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--no-evaluate", action="store_true", help="skip the kw.steer.evaluate timing")
    args = p.parse_args(argv)
    import torch

    import kvwire as kw
    from kvwire.steer.evaluate import Reference

    torch.set_num_threads(args.threads)
    lm = model(args.tiny)
    data = examples(args.examples)
    reference = Reference(lm, data, batch_size=args.batch)
    ans = reference.answers
    strengths = [float(s) for s in torch.linspace(-4, 4, args.strengths)]
    width = lm.head.weight.shape[1]
    print(header(args.threads))
    print(f"{args.strengths} strengths x {args.examples} examples ({sum(map(len, ans.texts))} prompt tokens), "
          f"{len(kw.block_calls(lm.backbone))} blocks")
    print(f"{'block':>5} {'steered':>9} {'loop s':>8} {'rows s':>8} {'ratio':>6} {'max |diff|':>10}")
    result = {}
    with torch.inference_mode():
        for layer in args.layers:
            vec = kw.ControlVector({layer: torch.randn(width, generator=torch.Generator().manual_seed(layer)) * 0.5})
            for when in args.when:
                rows(reference, vec, strengths[:2], when)  # warm-up: first-call allocations
                start = time.perf_counter()
                slow = loop(lm, vec, ans, strengths, when)
                t_loop = time.perf_counter() - start
                start = time.perf_counter()
                fast = rows(reference, vec, strengths, when)
                t_rows = time.perf_counter() - start
                gap = float((slow - fast).abs().max())
                assert gap < 1e-3, gap
                result[layer, when] = (t_loop, t_rows)
                print(f"{layer:>5} {when:>9} {t_loop:>8.2f} {t_rows:>8.2f} {t_loop / t_rows:>6.2f} {gap:>10.2e}",
                      flush=True)
        if args.no_evaluate:
            return result
        start = time.perf_counter()
        kw.steer.evaluate(lm, vec, data, strengths, batch_size=args.batch)
        print(f"kw.steer.evaluate at block {layer} (with side effects on the neutral text): "
              f"{time.perf_counter() - start:.2f} s")
    return result


if __name__ == "__main__":
    main()
