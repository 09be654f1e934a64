"""Exported default model (Gemma 3 270M) on onnxruntime vs kvwire eager vs llama.cpp, one process.

    python bench/export.py [--threads 2] [--new-tokens 32] [--max-length 1024]
                           [--formats onnx onnx-int4 executorch coreml]

Exports the cached graph to ONNX (float32, and int4 weights via onnxruntime's MatMulNBits
quantiser), to ExecuTorch (XNNPACK delegate; shapes are static in a .pte: exported for 4 rows,
batch-1 calls run padded to 4, with a 64-token prefill method and a decode method) and to Core ML (structure only: prediction needs macOS),
printing export time and file sizes; then runs the same kvwire generation loop on eager PyTorch,
onnxruntime and the ExecuTorch runtime, and llama.cpp on the GGUF when llama-cpp-python is
installed, interleaved, best of 3 (see bench/generate.py). Prints decode tokens/s (batch 1 and 4)
and prefill tokens/s (32 and 512 tokens) with ratios.

The runtimes are timed in a child process, each probed first in its own (load + 2 tokens): one
that is missing, raises or crashes gets a line saying so and is left out; if the timed child still
dies with peers in it, it is re-run with kvwire eager alone (see bench/generate.py).
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import crash_if_asked, header, probe_peers, run_worker, with_fallback  # noqa: E402
from generate import counting, kvwire_runner, llama_cpp_runner, measure, prompt_ids, timing  # noqa: E402


JOBS = {  # --formats name: (runner label, file name, kw.export options)
    "onnx": ("onnxruntime", "model.onnx", {}),
    "onnx-int4": ("onnxruntime int4", "int4.onnx", {"quantize": "int4"}),
    "executorch": ("executorch xnnpack", "model.pte", {"batch_size": 4, "prefill_length": 64}),
    "coreml": ("coreml (not run)", "model.mlpackage", {}),
}


def same_greedy_tokens(lm, exported, new_tokens=16):
    """(tokens equal to eager's position by position, tokens generated): a left-padded batch of 3."""
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):\n    return"]
    ours = exported.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, return_logprobs=True).tokens
    eager = lm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, return_logprobs=True).tokens
    return sum(a == b for x, y in zip(ours, eager) for a, b in zip(x, y)), sum(len(y) for y in eager)


def size_mb(path):
    path = Path(path)
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    data = Path(str(path) + ".data")
    return sum(f.stat().st_size for f in files + ([data] if data.is_file() else [])) / 1e6


def runner(name, files, threads):
    """generate(ids, n) of a peer: an exported file on its runtime, or llama.cpp on the GGUF."""
    import kvwire as kw

    if name == "llama.cpp":
        from kvwire.models.presets import PRESETS

        return llama_cpp_runner(str(PRESETS["gemma3-270m"]()), threads)
    generate = kvwire_runner(kw.load_exported(files[name], threads=threads))

    def crashable(ids, n):
        crash_if_asked(name)
        generate(ids, n)
    return crashable


def child(args, files):
    """--probe NAME: load it, generate 2 tokens; --timed: kvwire eager and --peers, interleaved."""
    import torch

    import kvwire as kw

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.probe:
        runner(args.probe, files, args.threads)(prompt_ids(counting, 16, 1), 2)
        return {"probed": args.probe}
    lm = kw.load("gemma3-270m", progress=False)
    runners = {"kvwire eager": kvwire_runner(lm), **{name: runner(name, files, args.threads) for name in args.peers}}
    rates, _ = measure({lib: timing(g) for lib, g in runners.items()}, lm.tokenizer.encode, args.new_tokens)
    return rates  # in one process: a runtime that dies takes the child with it (re-run without it)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--formats", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--probe", help=argparse.SUPPRESS)  # child process modes
    p.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--files", nargs="*", default=[], help=argparse.SUPPRESS)  # NAME=PATH
    args = p.parse_args()
    if args.probe or args.timed:
        print(json.dumps(child(args, dict(f.split("=", 1) for f in args.files))))
        return
    print(header(args.threads), flush=True)
    import torch

    import kvwire as kw

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lm = kw.load("gemma3-270m", progress=False)
    exported = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("| export | seconds | MB |\n|---|---:|---:|")
        for name, file, options in (JOBS[f] for f in args.formats):
            path = Path(tmp) / file
            start = time.perf_counter()
            kw.export(lm, path, max_length=args.max_length, **options)
            print(f"| {name} | {time.perf_counter() - start:.0f} | {size_mb(path):.0f} |", flush=True)
            if path.suffix in (".onnx", ".pte"):
                exported[name] = path
        common = ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
                  "--files", *(f"{name}={path}" for name, path in exported.items())]
        probes = probe_peers(__file__, [*exported, "llama.cpp"], common)
        failed = {name: r.failure for name, r in probes.items() if not r.ok}
        timed = [name for name in probes if name not in failed]
        result, note = with_fallback(
            lambda peers: run_worker(__file__, ["--timed", "--peers", *peers, *common]), timed)
        results = result.value or {}
        agreement = {name: same_greedy_tokens(lm, kw.load_exported(path))
                     for name, path in exported.items() if name in results}
    for name, failure in failed.items():
        print(f"{name}: not timed: {failure} (probe: load + 2 tokens)")
    if note:
        print(note)
    if not result.ok:
        print(f"kvwire eager: not timed: {result.failure}")
        return
    keys = list(next(iter(results.values())))
    print("\n| tokens/s | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for lib, row in results.items():
        print(f"| {lib} | " + " | ".join(f"{row[k]:.1f}" for k in keys) + " |")
    for name, (same, total) in agreement.items():
        print(f"{name}: {same}/{total} greedy tokens equal to eager's (3 prompts, a left-padded batch)")
    base = results["kvwire eager"]
    for lib, row in results.items():
        if lib != "kvwire eager":
            print(f"{lib} / kvwire eager: " + ", ".join(f"{k} {row[k] / base[k]:.2f}x" for k in keys))
    if "llama.cpp" in results:
        for lib in [k for k in results if k.startswith(("onnxruntime", "executorch"))]:
            print(f"{lib} / llama.cpp: " + ", ".join(f"{k} {results[lib][k] / results['llama.cpp'][k]:.2f}x"
                                                    for k in keys))


if __name__ == "__main__":
    main()
