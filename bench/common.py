"""Helpers shared by the benchmarks: timing, peak memory, running workers in subprocesses."""
import json
import os
import resource
import subprocess
import sys
import time


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def seconds(fn, repeat=1):
    """Best wall time of `repeat` calls of fn()."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_worker(script, args, env=None):
    """Run `python script args...` and parse the JSON it prints last."""
    out = subprocess.run([sys.executable, script, *args], check=True, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_variant(variant):
    """"dtype[+scheme][+head=Q][+compile][+cpp]" -> dict(dtype, quantize, head, compile, cpp).

    scheme: int8 / int4 (PyTorch kernels), gguf (the GGUF's own blocks) or a ggml type; head=Q
    re-quantises only the logits head to ggml type Q; compile: `lm.compile()`; cpp: compile with
    Inductor's C++ wrapper (`lm.compile(options={"cpp_wrapper": True})`)."""
    dtype, *parts = variant.split("+")
    spec = {"dtype": dtype, "quantize": None, "head": None, "compile": False, "cpp": False}
    for part in parts:
        if part in ("compile", "cpp"):
            spec["compile"] = True
            spec["cpp"] = spec["cpp"] or part == "cpp"
        elif part.startswith("head="):
            spec["head"] = part.removeprefix("head=")
        else:
            spec["quantize"] = part
    return spec


def load_variant(variant):
    """The default model as `variant` names it (compiled lazily: the first decode step compiles)."""
    import kvwire as kw

    spec = parse_variant(variant)
    lm = kw.load("gemma3-270m", dtype=spec["dtype"], progress=False, quantize=spec["quantize"])
    if spec["head"]:
        kw.quantize(lm, spec["head"], layers=False)
    if not spec["compile"]:
        return lm
    return lm.compile(options={"cpp_wrapper": True}) if spec["cpp"] else lm.compile()
