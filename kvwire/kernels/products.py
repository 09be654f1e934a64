"""Which kernel a product x @ W^T (+ b) takes on this CPU: `linear` computes it, `pack_kind` names the
packed copy a `layers.linear.WeightPack` keeps for it.

- Batch-1 decode (one float32 row) goes to kvwire's GEMV where `cpu.f32_row()` is "kvwire".
- bfloat16 and float16 products of many rows run in float32 from upcast weights where the CPU has
  no bf16 units (`cpu.bf16_gemm()` "upcast"): emulated bf16 GEMM is several times slower there.
- Few-row float32 products (decode) run as W @ x^T where `cpu.f32_gemv()` is "transposed" (MKL
  streams that form faster on AMD and AVX2 CPUs), with a row repeated for wide or square weights
  (an even row count streams them faster); many rows (prefill) keep `nn.functional.linear`.
- Packed copies: MKL's for the head at one row ("transposed"), for projections at 2-64 rows
  ("linear", where MKL's own `linear` runs a few rows at a fraction of memory speed); oneDNN's for the
  head at 2-64 rows and for bf16 products up to `PACKED_BF16_ROWS` rows; none where kvwire's GEMV
  reads the weight in place ("row").

docs/kernels.md gives the measurements behind each threshold.
"""
from contextlib import contextmanager

import torch
from torch import nn

from .cpu import bf16_gemm, f32_gemv, f32_row
from .native import gemv
from .tracing import is_exporting

SMALL_ROWS = 64
# bf16 products read oneDNN-packed weights up to this many rows; from ~384 rows oneDNN's own
# per-call path is the faster one
PACKED_BF16_ROWS = 256
_UPCAST = (torch.bfloat16, torch.float16)


_STEPS = []  # non-empty while kvwire exports one of its own compiled steps (`compiled_steps`)


@contextmanager
def compiled_steps():
    """While kvwire exports one of its own compiled steps (`generate.ahead`), few-row float32
    products keep the W @ x^T form this CPU streams faster, as plain ops in the graph: the compiled
    code would otherwise call MKL as x @ W^T (measured: the default model's head at 4 rows 13.6 ms
    against 2.7). Other exports (ONNX, ExecuTorch, Core ML) keep `linear`: their graph does not
    depend on the exporting CPU. Read at trace time, on the tracing thread's call."""
    _STEPS.append(True)
    try:
        yield
    finally:
        _STEPS.pop()


def linear(x, weight, bias=None):
    """x (..., in) @ weight (out, in)^T + bias -> (..., out), on the kernel this CPU runs fastest."""
    rows = x.numel() // x.shape[-1]
    if torch.compiler.is_compiling():
        # a compiled step's row count is static (an int) where its form may depend on it
        if _STEPS and isinstance(rows, int) and _transposed(x, rows):
            return _transposed_product(x, weight, bias, rows)
        return nn.functional.linear(x, weight, bias)
    if rows == 1 and x.dtype == torch.float32 and f32_row() == "kvwire" and gemv.applies(x, weight, bias):
        return gemv.product(x, weight, bias)  # batch-1 decode: kvwire's GEMV streams weights faster
    # bf16 GEMM costs about rows x GEMV here: from 8 rows, upcasting a (small) weight is cheaper
    upcast = rows > SMALL_ROWS or (rows > 4 and weight.numel() < 1 << 24)
    if upcast and x.dtype in _UPCAST and x.device.type == "cpu" and not (x.dtype == torch.bfloat16
                                                                        and bf16_gemm() != "upcast"):
        b = None if bias is None else bias.float()
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
    if not _transposed(x, rows):
        return nn.functional.linear(x, weight, bias)
    return _transposed_product(x, weight, bias, rows)


def siblings(x, modules):
    """[m(x) for m in modules]: linears reading the same x (a layer's q/k/v, a gated MLP's gate/up).
    Eager, where each is a ggml linear whose product on x is one ggml op (`ggml_operands`) and no hook
    watches it, they run as one `kvwire::ggml_matmuls` call: x's rows quantised once, every weight's
    rows in one parallel loop (compiled steps get the same from the pass in `ggml.fuse`). A module
    swapped or hooked by the user runs as it is. x (..., in) -> [(..., out_i)].

    Example:
        >>> q, k, v = siblings(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    """
    operands = _fusable(x, modules)
    if operands is None:
        return [m(x) for m in modules]
    rows = x.numel() // x.shape[-1]
    outs = torch.ops.kvwire.ggml_matmuls(x.reshape(rows, x.shape[-1]).float().contiguous(),
                                         [blocks for blocks, _ in operands], [kind for _, kind in operands],
                                         x.shape[-1])
    return [m.finish(out, x) for m, out in zip(modules, outs)]


def _fusable(x, modules):
    """Each module's (blocks, kernel type) where `siblings` may fuse them all, else None."""
    if not isinstance(x, torch.Tensor) or len(modules) < 2:  # (an fx tracer's proxy: traced as written)
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or is_exporting() or \
            nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    rows = x.numel() // x.shape[-1]
    operands = []
    for m in modules:
        find = getattr(m, "ggml_operands", None)
        if find is None or m._forward_hooks or m._forward_pre_hooks or m.in_features != x.shape[-1]:
            return None
        found = find(rows)
        if found is None:
            return None
        operands.append(found)
    return operands


def _transposed(x, rows):
    """Whether a product of `rows` rows of `x` runs as W @ x^T here."""
    return rows <= SMALL_ROWS and x.dtype == torch.float32 and f32_gemv() == "transposed"


def _transposed_product(x, weight, bias, rows):
    x2 = x.reshape(rows, x.shape[-1])
    if rows % 2 and weight.shape[0] >= weight.shape[1]:
        # an odd row count streams a wide or square weight slower than an even one: repeat the last
        # row and drop its result
        x2 = torch.cat((x2, x2[-1:]))
    # (rows, out), made contiguous (a few rows: a negligible copy) for the kernels that read it next
    out = (weight @ x2.t()).t()[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def pack_kind(role, rows, dtype, no_bias):
    """The packed kernel ("mkl", "onednn"; "row": kvwire's GEMV on the weight itself) a product of
    `rows` rows in `dtype` takes, or None. `role`: "head" (the language-model head) or "projection"."""
    if dtype == torch.bfloat16:
        if rows == 1 and role == "head" and f32_row() == "kvwire":
            return "row"  # kvwire's GEMV reads the head in place: no packed copy, faster (native/gemv.c)
        return "onednn" if bf16_gemm() == "packed" and rows <= PACKED_BF16_ROWS else None
    if dtype != torch.float32:
        return None
    if rows == 1 and f32_row() == "kvwire":
        return "row"  # kvwire's GEMV, on the weight itself (no copy)
    head = role == "head"
    # torch builds MKL's packed ops only alongside oneDNN: both are checked for them
    mkl = torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
    if f32_gemv() == "transposed":
        return "mkl" if head and rows == 1 and no_bias and mkl else None
    if not 2 <= rows <= SMALL_ROWS:
        return None
    if head:
        return "onednn" if no_bias and torch.backends.mkldnn.is_available() else None
    return "mkl" if mkl else None
