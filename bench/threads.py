"""Decode speed at several sizes of torch's CPU thread pool, on an idle machine and on one that other
work keeps busy.

    python bench/threads.py [--model gemma3-270m | smollm2-135m-instruct | tiny] [--variant float32]
                            [--threads 1 2] [--busy 1] [--new-tokens 32] [--repeat 3]

Each thread count runs in a fresh process with KVWIRE_THREADS set (the default: unset, torch's own
choice), its pool sized as kvwire's commands size it before any model work (`--threads` /
KVWIRE_THREADS), so no count inherits another's pool, caches or warm-up. Decode tokens/s at batch 1 after a 16-token
prompt: (new tokens - 1) / (time of N tokens - time of 1 token), the best of --repeat runs of each.
With `--busy N`, every thread count is timed again in the same run while N processes spin (a
`while True: pass` each, stopped afterwards): torch's OpenMP threads wait at every barrier for a
core a spinner holds, so on a busy machine fewer threads can be faster. The table gives tokens/s
and the ratio to the default thread count in the same condition; a worker that fails gets "-" and
a line saying why. The 1-minute load average before the idle runs tells how idle the machine was.

`--model tiny` is a random 2-layer llama built in the worker (no download), for tests.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_paths, header, load_variant, parse_variant, run_worker  # noqa: E402
from generate import counting, prompt_ids  # noqa: E402

MODELS = ("gemma3-270m", "smollm2-135m-instruct", "tiny")
SPIN = "while True: pass"


def tiny_model(dtype):
    """A random 2-layer llama (vocab 256, width 64) built from kvwire's own modules."""
    import torch

    from kvwire.load import build
    from kvwire.models import by_hf_model_type

    family = by_hf_model_type("llama")
    config = family.config_from_hf(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, bos_token_id=1, eos_token_id=2))
    with torch.device("meta"):
        shapes = family.backbone(config).state_dict()
    g = torch.Generator().manual_seed(0)
    return build(family, config, {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in shapes.items()},
                 dtype=getattr(torch, dtype))


def worker(args):
    """{"threads": torch's pool size, "decode": tokens/s} in this process, its pool sized first."""
    import torch

    from kvwire.cli.options import use_threads

    use_threads(argparse.Namespace())  # KVWIRE_THREADS, as every kvwire command reads it
    if args.model == "tiny":
        spec = parse_variant(args.variant)
        if spec["quantize"] or spec["head"] or spec["compile"]:
            raise ValueError(f"--model tiny takes a dtype only as its variant, got {args.variant!r}")
        lm, encode = tiny_model(spec["dtype"]), counting
    else:
        lm = load_variant(args.variant, args.model)
        encode = lm.tokenizer.encode
    ids = torch.tensor(prompt_ids(encode, 16, 1))

    def seconds(n):
        start = time.perf_counter()
        lm.generate(ids, max_new_tokens=n, ignore_eos=True)
        return time.perf_counter() - start
    seconds(2)  # warm up (a compiled variant compiles here)
    best = {1: float("inf"), args.new_tokens: float("inf")}
    for _ in range(args.repeat):
        for n in best:
            best[n] = min(best[n], seconds(n))
    first, last = best[1], best[args.new_tokens]
    rate = (args.new_tokens - 1) / (last - first) if last > first else float("nan")
    return {"threads": torch.get_num_threads(), "decode": rate}


@contextmanager
def spinners(n):
    """`n` processes spinning on a core each while the block runs; killed when it ends."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def fresh_default():
    """torch's thread count in a fresh process (this one's may have been resized)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                         text=True, check=True, env={**os.environ, "KVWIRE_THREADS": ""})
    return int(out.stdout.split()[-1])


def measure(counts, default, args):
    """{count: Worker} for each thread count, each in a fresh process (`default`: KVWIRE_THREADS unset)."""
    forwarded = ["--worker", "--model", args.model, "--variant", args.variant, "--new-tokens", str(args.new_tokens),
                 "--repeat", str(args.repeat)]
    return {n: run_worker(__file__, forwarded, {"KVWIRE_THREADS": "" if n == default else str(n)}, args.timeout)
            for n in counts}


def table(conditions, counts, default):
    """Rows of tokens/s and the ratio to the default thread count, a column pair per condition."""
    lines = [f"{'threads':14}" + "".join(f"{name + ' tok/s':>16}{'vs default':>12}" for name in conditions)]
    for n in counts:
        cells = ""
        for results in conditions.values():
            base, this = results[default], results[n]
            if not this.ok:
                cells += f"{'-':>16}{'':>12}"
                continue
            ratio = f"{this.value['decode'] / base.value['decode']:.2f}x" if base.ok else "-"
            cells += f"{this.value['decode']:16.2f}{ratio:>12}"
        lines.append(f"{label(n, default):14}" + cells)
    return lines


def label(n, default):
    return f"{n} (default)" if n == default else str(n)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m", choices=MODELS, help="a kvwire preset, or tiny (random, tests)")
    p.add_argument("--variant", default="float32", help="as bench/generate.py's variants (float32, bfloat16, "
                                                        "float32+gguf, ...+compile)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="thread counts besides torch's default (default: 1 2)")
    p.add_argument("--busy", type=int, default=0, metavar="N", help="also time every count while N processes spin")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="runs of each length in a worker, the best kept")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one worker")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one thread count's process
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    default = fresh_default()  # what a worker gets with KVWIRE_THREADS unset
    counts = sorted({*args.threads, default})
    print(header(default), flush=True)
    print(cpu_paths(), flush=True)
    print(f"model: {args.model} {args.variant}, batch 1, {args.new_tokens} new tokens after a 16-token prompt, "
          f"best of {args.repeat}; each thread count in a fresh process (KVWIRE_THREADS)"
          + (f"; busy: {args.busy} spinning process{'es' * (args.busy != 1)}" if args.busy else ""), flush=True)
    # other work on the machine makes "idle" busy too: the load average says how idle it was
    print(f"load average before the idle runs: {os.getloadavg()[0]:.2f}", flush=True)
    conditions = {"idle": measure(counts, default, args)}
    if args.busy:
        with spinners(args.busy):
            conditions["busy"] = measure(counts, default, args)
    for line in table(conditions, counts, default):
        print(line)
    for name, results in conditions.items():
        for n, result in results.items():
            if not result.ok:
                print(f"{name}, {label(n, default)} threads: not timed: {result.failure}")
            elif result.value["threads"] != n:
                print(f"{name}, {label(n, default)} threads: the worker's pool had {result.value['threads']}")


if __name__ == "__main__":
    main()
