"""Would an AOTInductor package of the decode step beat `lm.compile()`'s torch.compile step?

    python bench/aot_step.py [--model smollm2-135m-instruct | gemma3-270m] [--quantize gguf] [--slots 64]
                             [--steps 20] [--repeat 5] [--threads 2]

A batch-1 decode step of the preset, two ways, on the same inputs: `lm.compile()`'s step
(torch.compile + Inductor, called through dynamo's guards and Inductor's Python wrapper, as
generation calls it) and the exporters' `ExportProgram` (cached graph + head) through
`torch.export` and `torch._inductor.aoti_compile_and_package`, whose C++ runner has neither.
Prints both compile times, the best per-step time of `--repeat` interleaved runs of `--steps`
steps, and the largest logit difference. The exported step updates its caches functionally
(copying every slot, as exports do), so its time includes that copy; `lm.compile()`'s writes one
slot. This measures a candidate path: kvwire does not ship an AOTInductor decode step.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", choices=["gemma3-270m", "smollm2-135m-instruct"])
    p.add_argument("--quantize", default="gguf")
    p.add_argument("--slots", type=int, default=64, help="cache length (a compiled-step bucket)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import kvwire as kw
    from kvwire.export.program import ExportProgram

    torch.set_num_threads(args.threads)
    print(header(args.threads), flush=True)
    lm = kw.load(args.model, quantize=args.quantize, progress=False).compile(bucket=args.slots)
    decode = lm._decoder()
    prog = ExportProgram(lm, args.slots).eval()
    token, position, index = torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor(3)
    mask = torch.ones(1, args.slots, dtype=torch.bool)
    compiled_cache, flat_cache = lm.cached.init_cache(1, args.slots), lm.cached.init_cache(1, args.slots)
    flat = (token, position, index, mask, *[t for pair in flat_cache for t in pair])

    with torch.no_grad():
        start = time.perf_counter()
        compiled_logits, _ = decode(token, position, index, mask, compiled_cache, ())
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        package = torch._inductor.aoti_compile_and_package(torch.export.export(prog, flat, strict=False))
        runner = torch._inductor.aoti_load_package(package)
        aot_s = time.perf_counter() - start
        aot_logits = runner(*flat)[0][:, -1]
        calls = {"lm.compile() step": lambda: decode(token, position, index, mask, compiled_cache, ()),
                 "AOTInductor package": lambda: runner(*flat)}
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.repeat):  # interleaved: a noisy machine's drift hits both
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    call()
                best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
    print(f"model: {args.model}, quantize={args.quantize}, {args.slots} cache slots, batch 1")
    print(f"compile: lm.compile() {compile_s:.1f} s, export + AOTInductor {aot_s:.1f} s")
    for name, seconds in best.items():
        print(f"{name:22} {seconds * 1e3:7.2f} ms a step")
    ratio = best["lm.compile() step"] / best["AOTInductor package"]
    diff = (compiled_logits - aot_logits).abs().max().item()
    print(f"AOTInductor / lm.compile(): {ratio:.2f}x faster a step; largest logit difference {diff:.2g}")


if __name__ == "__main__":
    main()
