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
