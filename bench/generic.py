"""The generic path's speed: SmolLM2 through transformers' own modules with kvwire's cache, against
kvwire's native decoder and transformers' own `generate`, on the same weights, in one run.

    python bench/generic.py [--threads 2] [--new 48] [--rounds 3] [--tiny] [--compile]

Each engine decodes `--new` tokens greedily at batch 1 and 4, and prefills prompts of 32 and 512
tokens; the best of `--rounds` rounds is kept (rounds interleave the three, so a busy machine slows
all alike). Prints tokens/s and the ratios generic / transformers and generic / native, with the
CPU. `--tiny` runs a random 2-layer llama instead of the preset (for the smoke test).
`--compile` compiles both kvwire models (`lm.compile()`: steps built ahead of time and kept, the
builds done before timing starts) and leaves transformers eager (its `generate` re-traces with dynamo
in each process); the rows say which ran compiled.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

PRESET = "smollm2-135m-instruct"


def models(tiny):
    """(native kvwire, generic kvwire, transformers) on the same weights (float32)."""
    import kvwire as kw

    if tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from tests.conftest import FAMILIES

        def hf():  # the same seed: the same weights
            return FAMILIES["llama"]().eval()

        return kw.from_hf(hf()), kw.from_hf(hf(), generic=True), hf()
    import transformers
    from kvwire.models.presets import PRESETS

    folder = tempfile.mkdtemp()
    os.symlink(PRESETS[PRESET](), os.path.join(folder, "model.gguf"))

    def hf():  # one model each: the generic path sets the attention of the model it wraps
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf").eval()

    return kw.load(PRESET, progress=False), kw.from_hf(hf(), generic=True), hf()


def rates(native, generic, hf, batch, new, prompt):
    """{name: tokens/s}: decode `new` tokens after a `prompt`-token prompt at `batch` rows (new > 1),
    or the prefill of `batch` x `prompt` tokens (new == 1, counted as prompt tokens/s)."""
    import torch

    ids = torch.randint(3, 90, (batch, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def ours(lm):
        return lambda: lm.generate(list(ids), max_new_tokens=new, ignore_eos=True)

    def theirs():
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=0)

    out = {}
    for name, run in (("native", ours(native)), ("generic", ours(generic)), ("transformers", theirs)):
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        out[name] = batch * (new if new > 1 else prompt) / seconds
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--compile", action="store_true", help="compile both kvwire models (transformers stays eager)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    native, generic, hf = models(args.tiny)
    if args.compile:
        native.compile(), generic.compile()
    cases = [("decode b1", 1, args.new, 8), ("decode b4", 4, args.new, 8), ("prefill 32", 1, 1, 32),
             ("prefill 512", 1, 1, 64 if args.tiny else 512)]
    rates(native, generic, hf, 1, 4, 8)  # warm-up: first-call allocations and kernel picks
    if args.compile:  # every step the cases meet built (or loaded) before timing
        for case, batch, new, prompt in cases:
            rates(native, generic, hf, batch, min(new, 3), prompt)
    best = {case: {} for case, *_ in cases}
    for _ in range(args.rounds):
        for case, batch, new, prompt in cases:
            for name, rate in rates(native, generic, hf, batch, new, prompt).items():
                best[case][name] = max(best[case].get(name, 0.0), rate)
    print(header(args.threads))
    if args.compile:
        steps = {name: compiled_steps(lm) for name, lm in (("native", native), ("generic", generic))}
        print(f"compiled: native and generic (kept steps: native {steps['native']}, generic {steps['generic']}); "
              f"transformers eager")
    print(f"{'case':<12} {'native':>9} {'generic':>9} {'transformers':>13} {'gen/hf':>7} {'gen/native':>10}  (tokens/s)")
    for case, r in best.items():
        print(f"{case:<12} {r['native']:>9.1f} {r['generic']:>9.1f} {r['transformers']:>13.1f} "
              f"{r['generic'] / r['transformers']:>7.2f} {r['generic'] / r['native']:>10.2f}")


def compiled_steps(lm):
    """How many compiled (not eager) step programs `lm` holds."""
    decode = lm._decoder()
    return 0 if decode is None else sum(1 for r in getattr(decode, "runners", {}).values() if hasattr(r, "span"))


if __name__ == "__main__":
    main()
