"""Linear maps with a CPU kernel choice that matters for decoding.

For a few rows (decode: batch x 1 token), MKL's float32 GEMM is far faster on W @ x^T than on the
x @ W^T that `nn.functional.linear` runs: measured here, the 262144 x 640 head at 4 rows took
69 ms against 272 ms, a 2048 x 640 projection at 1 row 0.2 ms against 0.44 ms. With weights
streamed from memory (as in a real model), a wide weight (out > in) is read about 1.6x faster for
an even number of rows than for one or three, so odd row counts get one repeated row there.
Many rows (prefill) keep `linear`, which is slightly faster there. Compilers and exporters see
plain `linear`.

Reduced-precision weights stream half the bytes in decode (bf16 GEMV: 36 ms against 102 ms for the
head), but bf16 GEMM with many rows is slow on CPUs without native bf16 (512 x 640 x 2048: 86 ms
against 15 ms in float32), so many rows are computed in float32 from upcast weights.
"""
import torch
from torch import nn

SMALL_ROWS = 64
_UPCAST = (torch.bfloat16, torch.float16)


def linear(x, weight, bias=None):
    """x (..., in) @ weight (out, in)^T + bias -> (..., out)."""
    rows = x.numel() // x.shape[-1]
    if torch.compiler.is_compiling():
        return nn.functional.linear(x, weight, bias)
    # bf16 GEMM costs about rows x GEMV here: from 8 rows, upcasting a (small) weight is cheaper
    upcast = rows > SMALL_ROWS or (rows > 4 and weight.numel() < 1 << 24)
    if upcast and x.dtype in _UPCAST and x.device.type == "cpu":
        b = None if bias is None else bias.float()
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
    if rows > SMALL_ROWS or x.dtype != torch.float32:
        return nn.functional.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows % 2 and weight.shape[0] > weight.shape[1]:
        # one or three rows stream a wide weight at ~6.5 GB/s, two or four at ~10-11 (bench/gemv.py):
        # repeat the last row and drop its result
        x2 = torch.cat((x2, x2[-1:]))
    out = (weight @ x2.t()).t()[:rows]  # (rows, out)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` computed with `linear` above (same parameters, same results)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
