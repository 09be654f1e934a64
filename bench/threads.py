"""Decode speed at several sizes of torch's CPU thread pool and with kvwire's default (the pool sized
by each step's load), on an idle machine and on one that other work keeps busy, beside llama.cpp.

    python bench/threads.py [--model gemma3-270m | smollm2-135m-instruct | tiny] [--variant float32]
                            [--threads 1 2] [--peer llama.cpp] [--busy 1] [--new-tokens 32] [--repeat 3]

Each row runs in a fresh process: kvwire with KVWIRE_THREADS set to each count (pinned: kept
whatever the load), kvwire's default ("auto": KVWIRE_THREADS unset, so each engine step runs on one
thread fewer for every core other processes keep busy, `kvwire.kernels.threads`), and with `--peer
llama.cpp` llama.cpp (llama-cpp-python) on the preset's GGUF at each count and at the machine's
default count (the cores, as its CLI). Decode tokens/s at batch 1 after a 16-token prompt: (new
tokens - 1) / (time of N tokens - time of 1 token), the best of --repeat runs of each.
With `--busy N`, every row is timed again in the same run while N processes spin (a
`while True: pass` each, stopped afterwards): OpenMP threads wait at every barrier for a core a
spinner holds. The table gives tokens/s per condition and busy / idle; the summary gives kvwire's
default under load against its idle speed and against llama.cpp under the same load. A worker that
fails gets "-" and a line saying why. The 1-minute load average before the idle runs tells how idle
the machine was.

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
    """{"threads": torch's pool size, "decode": tokens/s, "stepped_on": the thread count kvwire's
    engines last chose (None: pinned)} in this process, its pool sized first; `--lib llama.cpp`
    times llama.cpp on the preset's GGUF with `--threads-of-peer` threads instead."""
    import torch

    if args.lib == "llama.cpp":
        return llama_cpp_worker(args)
    from kvwire.cli.options import use_threads
    from kvwire.kernels.threads import adaptive

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
    rate = decode_rate(lambda n: lm.generate(ids, max_new_tokens=n, ignore_eos=True), args)
    governor = adaptive()  # the process's one, which every engine of these calls followed
    return {"threads": torch.get_num_threads(), "decode": rate, "stepped_on": governor and governor.n}


def llama_cpp_worker(args):
    from llama_cpp import Llama

    from kvwire.models.presets import PRESETS

    llm = Llama(str(PRESETS[args.model]()), n_threads=args.peer_threads, n_ctx=256, verbose=False)
    ids = prompt_ids(lambda text: llm.tokenize(text.encode()), 16, 1)[0]

    def generate(n):
        llm.reset()
        for count, _ in enumerate(llm.generate(ids, temp=0.0), start=1):
            if count == n:
                break
    return {"threads": args.peer_threads, "decode": decode_rate(generate, args), "stepped_on": None}


def decode_rate(generate, args):
    """(new tokens - 1) / (time of N tokens - time of 1), the best of --repeat runs of each."""
    def seconds(n):
        start = time.perf_counter()
        generate(n)
        return time.perf_counter() - start
    seconds(2)  # warm up (a compiled variant compiles here)
    best = {1: float("inf"), args.new_tokens: float("inf")}
    for _ in range(args.repeat):
        for n in best:
            best[n] = min(best[n], seconds(n))
    first, last = best[1], best[args.new_tokens]
    return (args.new_tokens - 1) / (last - first) if last > first else float("nan")


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


def rows_of(args, default):
    """[(library, threads)]: kvwire pinned at each count, kvwire's default ("auto": KVWIRE_THREADS
    unset, the pool sized by torch and each step by the machine's load), then the peer's counts."""
    rows = [("kvwire", n) for n in sorted(set(args.threads))] + [("kvwire", "auto")]
    if args.peer:
        rows += [(args.peer, n) for n in sorted({*args.threads, default})]
    return rows


def measure(rows, args):
    """{row: Worker}, each row in a fresh process."""
    forwarded = ["--worker", "--model", args.model, "--variant", args.variant, "--new-tokens", str(args.new_tokens),
                 "--repeat", str(args.repeat)]
    results = {}
    for lib, n in rows:
        if lib == "kvwire":
            results[lib, n] = run_worker(__file__, forwarded, {"KVWIRE_THREADS": "" if n == "auto" else str(n)},
                                         args.timeout)
        else:
            results[lib, n] = run_worker(__file__, forwarded + ["--lib", lib, "--peer-threads", str(n)], {},
                                         args.timeout)
    return results


def table(conditions, rows):
    """A row per (library, threads): tokens/s in each condition and, with a busy run, busy / idle."""
    names = list(conditions)
    lines = [f"{'library':10}{'threads':>9}" + "".join(f"{name + ' tok/s':>14}" for name in names)
             + (f"{'busy/idle':>11}" if "busy" in conditions else "")]
    for row in rows:
        got = [conditions[name][row] for name in names]
        cells = "".join(f"{r.value['decode']:14.2f}" if r.ok else f"{'-':>14}" for r in got)
        if "busy" in conditions:
            idle, busy = conditions["idle"][row], conditions["busy"][row]
            cells += f"{busy.value['decode'] / idle.value['decode']:10.2f}x" if idle.ok and busy.ok else f"{'-':>11}"
        lines.append(f"{row[0]:10}{str(row[1]):>9}" + cells)
    return lines


def summary(conditions, default):
    """The goal's two ratios: kvwire's default busy / idle, and busy kvwire / busy peer (at the peer's
    default count, the cores, and at its best count)."""
    if "busy" not in conditions:
        return []
    idle, busy = conditions["idle"], conditions["busy"]
    auto = ("kvwire", "auto")
    if not (idle[auto].ok and busy[auto].ok):
        return []
    lines = [f"kvwire (default) under load: {busy[auto].value['decode'] / idle[auto].value['decode']:.2f}x of its "
             f"idle decode"]
    peers = {row: r.value["decode"] for row, r in busy.items() if row[0] != "kvwire" and r.ok}
    if peers:
        at_default = [rate for (lib, n), rate in peers.items() if n == default]
        best_row = max(peers, key=peers.get)
        if at_default:
            lines.append(f"kvwire (default) / {best_row[0]} at {default} threads (its default), both under load: "
                         f"{busy[auto].value['decode'] / at_default[0]:.2f}x")
        lines.append(f"kvwire (default) / {best_row[0]} at its best count ({best_row[1]}), both under load: "
                     f"{busy[auto].value['decode'] / peers[best_row]:.2f}x")
    return lines


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m", choices=MODELS, help="a kvwire preset, or tiny (random, tests)")
    p.add_argument("--variant", default="float32", help="as bench/generate.py's variants (float32, bfloat16, "
                                                        "float32+gguf, ...+compile)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="pinned thread counts timed besides kvwire's default (default: 1 2)")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp on the preset's GGUF at each count (and at torch's default count)")
    p.add_argument("--busy", type=int, default=0, metavar="N", help="also time every row while N processes spin")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="runs of each length in a worker, the best kept")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one worker")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one row's process
    p.add_argument("--lib", default="kvwire", help=argparse.SUPPRESS)
    p.add_argument("--peer-threads", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.peer and args.model == "tiny":
        p.error("--peer needs a preset's GGUF; --model tiny has none")
    default = fresh_default()  # torch's pool in a fresh process: kvwire's default count, llama.cpp's CLI's
    rows = rows_of(args, default)
    print(header(default), flush=True)
    print(cpu_paths(), flush=True)
    print(f"model: {args.model} {args.variant}, batch 1, {args.new_tokens} new tokens after a 16-token prompt, "
          f"best of {args.repeat}; each row in a fresh process (kvwire's counts pinned by KVWIRE_THREADS; auto: "
          f"unset)" + (f"; busy: {args.busy} spinning process{'es' * (args.busy != 1)}" if args.busy else ""),
          flush=True)
    # other work on the machine makes "idle" busy too: the load average says how idle it was
    print(f"load average before the idle runs: {os.getloadavg()[0]:.2f}", flush=True)
    conditions = {"idle": measure(rows, args)}
    if args.busy:
        with spinners(args.busy):
            conditions["busy"] = measure(rows, args)
    for line in table(conditions, rows) + summary(conditions, default):
        print(line)
    for name, results in conditions.items():
        for (lib, n), result in results.items():
            if not result.ok:
                print(f"{name}, {lib} {n}: not timed: {result.failure}")
            elif lib == "kvwire" and n != "auto" and result.value["threads"] != n:
                print(f"{name}, {lib} {n}: the worker's pool had {result.value['threads']}")
            elif (lib, n) == ("kvwire", "auto"):
                print(f"{name}, kvwire auto: a pool of {result.value['threads']}, steps last on "
                      f"{result.value['stepped_on']}")


if __name__ == "__main__":
    main()
