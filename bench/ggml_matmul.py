"""Where each of GGMLLinear's matrix products wins, per ggml format and row count: the row
loop (one `vec_dot` per weight row and activation row), ggml's own graph (`MUL_MAT`, tiled as
llama.cpp runs it), dequantise + float32 GEMM (MKL), and for Q4_1, Q5_0, Q8_0 and Q4_K kvwire's x16
kernel on repacked blocks (where the CPU runs it for the format: AVX-512 VNNI, or AVX2 for Q8_0 and Q4_K). Sets the crossovers in kvwire/quant/ggml/matmul.c
(`kvw_matmuls`) and linear.py (`UNTILED`, `MANY_ROWS`).

    python bench/ggml_matmul.py [--rows 1 2 3 8 32 512] [--formats q4_k q8_0 ...] [--threads 2]

A (1536, 1024) Gaussian weight quantised by ggml to each format, plus the default model's head
shape (262144 x 640, Q8_0) at few rows; milliseconds a call, best of 3 timed groups, one process.
"""
import argparse
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

P, I64 = ctypes.c_void_p, ctypes.c_int64


def product(fn, layer, x, threads):
    """One call of matmul.c's kvw_loop_matmuls / kvw_graph_matmuls on one weight."""
    y = torch.empty(x.shape[0], layer.out_features)
    rc = fn(1, (ctypes.c_int * 1)(layer.kernel_type), (P * 1)(layer.blocks.data_ptr()), (I64 * 1)(layer.out_features),
            I64(layer.in_features), P(x.data_ptr()), I64(x.shape[0]), (P * 1)(y.data_ptr()), threads)
    if rc:
        raise RuntimeError(f"{fn.__name__} returned {rc}")
    return y


def ms(fn, budget=0.3):
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(budget / once / 3))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main():
    from kvwire.kernels.ggml.lib import library, x16_runs
    from kvwire.quant.ggml.linear import QUANTIZE_TYPES, X16, GGMLLinear, qtype_of

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 8, 32, 128, 512])
    p.add_argument("--formats", nargs="+", default=[t.lower() for t in QUANTIZE_TYPES])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = library()
    print(header(args.threads))
    print(f"{'format':8}{'shape':>14}{'rows':>6}{'loop ms':>10}{'graph ms':>10}{'deq+mkl ms':>12}{'x16 ms':>9}"
          "  fastest")
    g = torch.Generator().manual_seed(0)
    cases = [(name, torch.randn(1536, 1024, generator=g), args.rows) for name in args.formats]
    cases.append(("q8_0", torch.randn(262144, 640, generator=g), [r for r in args.rows if r <= 8]))
    for name, weight, rows_list in cases:
        layer = GGMLLinear.quantize(weight, name, kernel="ggml")  # ggml's layout (kernel= is Q4_1's alone)
        x16 = GGMLLinear.quantize(weight, name, kernel="x16") if qtype_of(name) in X16 and x16_runs(int(qtype_of(name))) \
            else None
        del weight
        for rows in rows_list:
            x = torch.randn(rows, layer.in_features, generator=g)
            times = {"loop": ms(lambda: product(lib.kvw_loop_matmuls, layer, x, args.threads)),
                     "graph": ms(lambda: product(lib.kvw_graph_matmuls, layer, x, args.threads))}
            if layer.out_features * layer.in_features <= 4 << 20:  # a float copy of the head: skipped
                times["deq+mkl"] = ms(lambda: torch.nn.functional.linear(x, layer.dequantize()))
            if x16 is not None:
                times["x16"] = ms(lambda: product(lib.kvw_loop_matmuls, x16, x, args.threads))
            shape = f"{layer.out_features}x{layer.in_features}"
            print(f"{name:8}{shape:>14}{rows:6d}{times['loop']:10.3f}{times['graph']:10.3f}"
                  f"{times.get('deq+mkl', float('nan')):12.3f}{times.get('x16', float('nan')):9.3f}"
                  f"  {min(times, key=times.get)}", flush=True)


if __name__ == "__main__":
    main()
