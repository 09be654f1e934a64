"""Which float32 GEMV layout streams fastest here: the default model's head (262144 x 640) and a
few layer shapes, one row of activations, 2 threads. Guides issue 3 (eager batch-1 decode).

    python bench/gemv.py
"""
import time

import torch


def ms(fn, repeat):
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def main():
    torch.set_num_threads(2)
    print("| out x in | W @ h^T (kvwire now) | F.linear | h @ W^T stored transposed |\n|---|---:|---:|---:|")
    for out_f, in_f, repeat in [(262144, 640, 20), (2048, 640, 200), (640, 2048, 200), (1024, 640, 200)]:
        W = torch.randn(out_f, in_f)
        Wt = W.t().contiguous()
        h = torch.randn(1, in_f)
        row = [ms(lambda: W @ h.T, repeat), ms(lambda: torch.nn.functional.linear(h, W), repeat),
               ms(lambda: h @ Wt, repeat)]
        print(f"| {out_f} x {in_f} | " + " | ".join(f"{t:.3f} ms" for t in row) + " |")


if __name__ == "__main__":
    main()
