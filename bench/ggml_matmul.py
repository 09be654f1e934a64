"""Where each of GGMLLinear's matrix products wins, per ggml format and row count: the row
loop (one `vec_dot` per weight row and activation row), ggml's own graph (`MUL_MAT`, tiled as
llama.cpp runs it), dequantise + float32 GEMM (MKL), and for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K kvwire's x16
kernel on repacked blocks (where the CPU runs it for the format: AVX-512 VNNI, or AVX2 for Q8_0, Q4_K
and Q6_K). Sets the crossovers in kvwire/quant/ggml/matmul.c
(`kvw_matmuls`) and linear.py (`UNTILED`, `MANY_ROWS`).

The "repack" column is llama.cpp's own path for a weight on such CPUs: the weight in ggml's CPU
extra buffer (`CPU_REPACK`: ggml interleaves Q4_0, Q4_K, Q8_0, IQ4_NL ... rows there at load, as
llama.cpp does) and the product through ggml's CPU backend (`bench/ggml_repack.c`, built on first
use against llama-cpp-python's ggml), for the formats ggml repacks on x86 (`REPACKED`; ggml says
"repack tensor ... with" on stderr for each weight it repacks).

    python bench/ggml_matmul.py [--rows 1 2 3 8 32 512] [--formats q4_k q8_0 ...] [--threads 2] [--no-repack]
                                [--as-avx2]

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


# formats ggml repacks on x86 CPUs with AVX2 or AVX-512 (others are left out: the helper refuses a
# weight ggml would not repack, and the column says nan)
REPACKED = {"q4_0", "q4_k"}


def repack_library():
    """bench/ggml_repack.c, built against llama-cpp-python's ggml (once) and loaded."""
    from kvwire.kernels.build import library
    from kvwire.kernels.ggml.lib import ggml_dirs

    lib_dir, include = ggml_dirs()
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ggml_repack.c")
    # --no-as-needed: the libraries come before the source on the command line
    flags = ["-O2", f"-I{include}", f"-L{lib_dir}", "-Wl,--no-as-needed", "-lggml-cpu", "-lggml-base", "-lggml",
             f"-Wl,-rpath,{lib_dir}"]
    lib = ctypes.CDLL(str(library("bench_ggml_repack", [source], flags, folder="ggml", what="the bench's repack helper")))
    lib.kvb_repack_name.restype = ctypes.c_char_p
    lib.kvb_repack_open.argtypes, lib.kvb_repack_open.restype = [ctypes.c_int, P, I64, I64, ctypes.c_int,
                                                                 ctypes.c_int], P
    lib.kvb_repack_matmul.argtypes, lib.kvb_repack_matmul.restype = [P, P, P], ctypes.c_int
    lib.kvb_repack_close.argtypes, lib.kvb_repack_close.restype = [P], None
    return lib


def repacked_product(lib, layer, x, threads):
    """A function timing nothing: y = x @ W^T through ggml's CPU backend with W in its extra (repack)
    buffer, W repacked once here (the caller times the product); None where there is no such buffer."""
    handle = lib.kvb_repack_open(int(layer.qtype), layer.blocks.data_ptr(), layer.in_features, layer.out_features,
                                 x.shape[0], threads)
    if not handle:
        return None, lambda: None
    y = torch.empty(x.shape[0], layer.out_features)

    def run():
        if lib.kvb_repack_matmul(handle, x.data_ptr(), y.data_ptr()):
            raise RuntimeError("ggml's compute failed on the repacked weight")
        return y
    return run, lambda: lib.kvb_repack_close(handle)


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
    from kvwire.quant.ggml.linear import QUANTIZE_TYPES

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 8, 32, 128, 512])
    p.add_argument("--formats", nargs="+", default=[t.lower() for t in QUANTIZE_TYPES])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-repack", action="store_true", help="leave out ggml's repacked kernels (llama.cpp's path)")
    p.add_argument("--as-avx2", action="store_true",
                   help="run x16 as a CPU with AVX2 but no AVX-512 VNNI would (its AVX2 kernels, on an AVX-512 CPU)")
    args = p.parse_args()
    if args.as_avx2:
        from kvwire.kernels.ggml.lib import as_avx2

        with as_avx2():
            return run(args)
    return run(args)


def run(args):
    from kvwire.kernels.build import BuildError
    from kvwire.kernels.ggml.lib import library, x16_runs
    from kvwire.quant.ggml.linear import X16, GGMLLinear, qtype_of

    torch.set_num_threads(args.threads)
    lib = library()
    repack = None
    if not args.no_repack:
        try:
            repack = repack_library()
        except (BuildError, OSError) as e:  # no headers or compiler for the helper: the column stays empty
            print(f"no repack column: {type(e).__name__}: {e}")
    print(header(args.threads) + ("  (x16 as on AVX2 without AVX-512 VNNI)" if args.as_avx2 else ""))
    if repack is not None:
        name = repack.kvb_repack_name()
        print(f"ggml's extra buffer on this CPU: {name.decode() if name else 'none (repack column empty)'}")
    print(f"{'format':8}{'shape':>14}{'rows':>6}{'loop ms':>10}{'graph ms':>10}{'deq+mkl ms':>12}{'x16 ms':>9}"
          f"{'repack ms':>11}  fastest")
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
            if repack is not None and name in REPACKED:
                run, close = repacked_product(repack, layer, x, args.threads)
                if run is not None:
                    want = product(lib.kvw_graph_matmuls, layer, x, args.threads)
                    torch.testing.assert_close(run(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
                    times["repack"] = ms(run)
                close()
            shape = f"{layer.out_features}x{layer.in_features}"
            print(f"{name:8}{shape:>14}{rows:6d}{times['loop']:10.3f}{times['graph']:10.3f}"
                  f"{times.get('deq+mkl', float('nan')):12.3f}{times.get('x16', float('nan')):9.3f}"
                  f"{times.get('repack', float('nan')):11.3f}  {min(times, key=times.get)}", flush=True)


if __name__ == "__main__":
    main()
