"""Which float32 GEMV layout streams fastest here: the default model's head (262144 x 640) and its
layer shapes, then SmolLM2-135M's, one activation row, 2 threads. Guides `kvwire.layers.linear`.

    python bench/gemv.py

Weights are streamed from memory as in a real decode step (enough copies of each shape to exceed
the caches, called in turn); a weight kept hot in cache, as a naive loop would, hides the effect.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

STREAM_BYTES = 400e6


def ms_per_call(fn, weights, repeat=3):
    for w in weights:
        fn(w)
    start = time.perf_counter()
    for _ in range(repeat):
        for w in weights:
            fn(w)
    return (time.perf_counter() - start) / (repeat * len(weights)) * 1000


def main():
    torch.set_num_threads(2)
    print(header(2), flush=True)
    packed = torch.backends.mkl.is_available()
    print("| out x in | W @ h^T (1 row) | W @ [h; h]^T (row repeated) | F.linear | h @ W^T stored transposed "
          "| MKL-packed copy |")
    print("|---|---:|---:|---:|---:|---:|")
    gemma3 = [(262144, 640), (2048, 640), (640, 2048), (1024, 640), (256, 640)]
    smollm2 = [(1536, 576), (576, 1536), (576, 576), (192, 576)]
    for out_f, in_f in gemma3 + smollm2:
        copies = max(1, int(STREAM_BYTES / (out_f * in_f * 4)))
        weights = [torch.randn(out_f, in_f) for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights]
        h = torch.randn(1, in_f)
        hh = torch.cat((h, h))
        row = [ms_per_call(lambda w: w @ h.T, weights), ms_per_call(lambda w: (w @ hh.T)[:, :1], weights),
               ms_per_call(lambda w: torch.nn.functional.linear(h, w), weights),
               ms_per_call(lambda w: h @ w, transposed)]
        if packed:  # what kvwire's OneRowPack runs for the head at batch 1
            packs = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in weights]
            row.append(ms_per_call(lambda p: torch.ops.mkl._mkl_linear(h, p[0], p[1], None, 1), packs))
            del packs
        print(f"| {out_f} x {in_f} | " + " | ".join(f"{t:.3f} ms" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()
