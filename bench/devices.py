"""Decode speed on an accelerator, and greedy agreement with the CPU, for the presets.

    python bench/devices.py --device cuda [--models gemma3-270m smollm2-135m-instruct] [--new-tokens 64]
                            [--batch 1 4] [--dtype float32] [--threads 2]

Each preset is loaded twice, `kw.load(model, dtype=...)` on the CPU and `kw.load(model, dtype=...,
device=...)`. Decode tokens/s at each batch size is (n - 1) / (time(n new tokens) - time(1 new
token)), greedy with ignore_eos, best of 3: the prefill and the first token cancel out, and the
time is synchronised because generation reads every token back to Python. The CPU's rate is timed
the same way for the ratio. Agreement: greedy continuations of a few prompts (batched, left-padded)
on the device against the CPU, as the tokens equal before the first difference (float rounding
differs between devices, so a near-tie may flip late in a long continuation; greedy decisions up to
there are the same). A preset whose package is missing gets a line saying so.

Exits with status 2 and the reason when the device cannot be used in this process (a torch without
CUDA, no GPU, a bad name).
"""
import argparse
import os
import sys
import time

import torch

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):", "The three laws of thermodynamics are"]


def decode_rate(lm, prompts, new_tokens, repeat=3):
    """Greedy decode tokens/s per row at batch len(prompts) (see the module docstring)."""
    def best(n):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            lm.generate(prompts, max_new_tokens=n, ignore_eos=True)
            times.append(time.perf_counter() - start)
        return min(times)

    lm.generate(prompts, max_new_tokens=2, ignore_eos=True)  # warm-up: kernels, caches, the cached graph
    return (new_tokens - 1) / max(best(new_tokens) - best(1), 1e-9)


def agreement(cpu, device_lm, new_tokens):
    """(tokens equal before the first difference, tokens compared) over PROMPTS."""
    ids = [torch.tensor(cpu.tokenizer.encode(p)) for p in PROMPTS]
    want = cpu.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
    got = device_lm.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
    same = 0
    for a, b in zip(want, got):
        a, b = a.tolist(), b.tolist()
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same, sum(len(a) for a in want)


def bench_model(name, device, args):
    import kvwire as kw

    try:
        cpu = kw.load(name, dtype=args.dtype, progress=False)
    except ValueError as e:  # a preset whose package is not installed
        print(f"{name}: skipped ({e})")
        return
    start = time.perf_counter()
    on_device = kw.load(name, dtype=args.dtype, progress=False, device=device)
    print(f"{name} ({args.dtype}): loaded on {device} in {time.perf_counter() - start:.1f} s")
    for batch in args.batch:
        prompts = (PROMPTS * batch)[:batch]
        fast, slow = decode_rate(on_device, prompts, args.new_tokens), decode_rate(cpu, prompts, args.new_tokens)
        print(f"  batch {batch}: decode {fast:8.1f} tokens/s per row on {device}, {slow:7.1f} on the CPU "
              f"({fast / slow:.2f}x)")
    same, total = agreement(cpu, on_device, args.new_tokens)
    print(f"  greedy agreement with the CPU: {same}/{total} tokens before the first difference"
          + (" (all equal)" if same == total else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="the accelerator to measure (cuda, cuda:1, ...)")
    p.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m-instruct"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="CPU threads (the CPU reference)")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    from kvwire.dtypes import weights_device

    try:
        device = weights_device(args.device)
    except (ValueError, TypeError) as e:
        print(f"bench/devices.py: {e}; nothing measured", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"device: {device} ({name}); torch {torch.__version__}; CPU reference: {os.cpu_count()} cores, "
          f"{args.threads} threads; {args.new_tokens} new tokens")
    for model in args.models:
        bench_model(model, device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
