"""Linear maps with a CPU kernel choice that matters for decoding.

For a few rows (decode: batch x 1 token), MKL's float32 GEMM is far faster on W @ x^T than on the
x @ W^T that `nn.functional.linear` runs: measured here, the 262144 x 640 head at 4 rows took
69 ms against 272 ms, a 2048 x 640 projection at 1 row 0.2 ms against 0.44 ms. With weights
streamed from memory (as in a real model), a wide weight (out > in) is read about 1.6x faster for
an even number of rows than for one or three, and a square one about 1.5x (bench/gemv.py on an
AVX2 CPU: 576 x 576 in 0.154 against 0.236 ms), so odd row counts get one repeated row there; a
narrow one (out < in, a down projection) reads slower so (640 x 2048: 0.58 against 0.44 ms).
Many rows (prefill) keep `linear`, which is slightly faster there. Compilers and exporters see
plain `linear`.

Reduced-precision weights stream half the bytes in decode (bf16 GEMV: 36 ms against 102 ms for the
head), but bf16 GEMM with many rows is slow on CPUs without native bf16 (512 x 640 x 2048: 86 ms
against 15 ms in float32), so there many rows are computed in float32 from upcast weights; CPUs
with bf16 units (AVX512_BF16, AMX) keep them in bf16 (`cpu.bf16_gemm`).
"""
import torch
from torch import nn

from .cpu import bf16_gemm
from .tracing import is_exporting

SMALL_ROWS = 64
_UPCAST = (torch.bfloat16, torch.float16)


def linear(x, weight, bias=None):
    """x (..., in) @ weight (out, in)^T + bias -> (..., out)."""
    rows = x.numel() // x.shape[-1]
    if torch.compiler.is_compiling():
        return nn.functional.linear(x, weight, bias)
    # bf16 GEMM costs about rows x GEMV here: from 8 rows, upcasting a (small) weight is cheaper
    upcast = rows > SMALL_ROWS or (rows > 4 and weight.numel() < 1 << 24)
    if upcast and x.dtype in _UPCAST and x.device.type == "cpu" and not (x.dtype == torch.bfloat16
                                                                        and bf16_gemm() == "native"):
        b = None if bias is None else bias.float()
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
    if rows > SMALL_ROWS or x.dtype != torch.float32:
        return nn.functional.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows % 2 and weight.shape[0] >= weight.shape[1]:
        # one or three rows stream a wide weight at ~6.5 GB/s, two or four at ~10-11, and a square
        # one 1.5x faster so too (bench/gemv.py): repeat the last row and drop its result
        x2 = torch.cat((x2, x2[-1:]))
    out = (weight @ x2.t()).t()[:rows]  # (rows, out)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneRowPack:
    """An MKL-packed copy of a float32 weight for one-row products (batch-1 decode): the default
    model's 262144 x 640 head in 43-49 ms instead of 54-58 ms with the repeated row or 74-77 ms
    with `linear` (two runs of bench/gemv.py); batch-1 decode 10.2 against 8.8 tokens/s unpacked
    (best of 4, interleaved), for a second copy of the weight in memory (671 MB there). The copy
    is made once `after` one-row products have read the same weight, and rebuilt when the weight
    changes (in-place edits bump its version). Packing the default model's head takes about a
    second, which ~100 decode steps win back: packing at the first call made every short run
    (`kvwire generate`, a first token) that second slower.

    Call `pack(x, weight)`: the product (1, out), or None where it does not apply (other dtypes
    or row counts, autograd, compilers and exporters, no MKL, not yet `after` calls); the caller
    falls back to `linear`.
    """

    def __init__(self, after=64):
        self.key = self.packed = None
        self.after, self.calls = after, (None, 0)  # (weight key, one-row calls seen with it)

    def __call__(self, x, weight):
        if torch.compiler.is_compiling() or is_exporting():  # first: compilers cannot trace the rest
            return None
        rows = x.numel() // x.shape[-1]
        if (rows != 1 or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
                or type(x) is not torch.Tensor or not torch.backends.mkl.is_available()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return None
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self.key:
            self.packed, self.key = None, None  # a stale copy (the weight changed) goes at once
            seen, count = self.calls
            count = count + 1 if seen == key else 1
            self.calls = (key, count)
            if count < self.after:
                return None
            self.packed, self.key = None, None  # free the old copy before packing the new one
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 1)
            self.key = key
        out = torch.ops.mkl._mkl_linear(x.reshape(1, -1), self.packed, weight, None, 1)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def clear(self):
        self.key = self.packed = None
        self.calls = (None, 0)

    def __deepcopy__(self, memo):  # a copied model packs its own weight when it needs to
        return OneRowPack(self.after)


class Linear(nn.Linear):
    """`nn.Linear` computed with `linear` above (same parameters, same results)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
