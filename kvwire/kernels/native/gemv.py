"""One-row float32 and bfloat16 products on kvwire's AVX-512 GEMV (`gemv.c`), reading the weight in place.

A batch-1 decode step is one GEMV per weight, bound by how fast the weights stream from memory;
this kernel streams them faster than MKL's `linear` and than oneDNN's packed bf16 copy, with no
copy of its own (docs/kernels.md, Measurements). `cpu.f32_row()` decides where it is used.

Example:
    >>> w, x = torch.randn(40, 24), torch.randn(1, 24)
    >>> torch.allclose(product(x, w), x @ w.T, atol=1e-5) if available() else True
    True
"""
import ctypes
from pathlib import Path

import torch

from ..build import builds, library, loaded
from ..tracing import is_exporting, transformed

SOURCE = Path(__file__).with_name("gemv.c")
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]  # built and called only where the CPU has AVX-512F
_LIB = {}  # "lib": the loaded library, or "error": why it could not be built


def load():
    """The loaded kernel library, built on first use; raises `BuildError` (remembered: one try a
    process)."""
    return loaded(_LIB, lambda: library("kvw_gemv", [SOURCE], FLAGS), _declare)


def _declare(lib):
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvw_gemv_f32.argtypes, lib.kvw_gemv_f32.restype = [p, i64, p, p, p, i64, i64, ctypes.c_int], None
    lib.kvw_gemv_bf16.argtypes, lib.kvw_gemv_bf16.restype = [p, i64, p, p, p, p, i64, i64, ctypes.c_int], None


def available():
    """Whether the kernel is built and loaded here (building it if needed); the CPU is not checked."""
    return builds(load)


def unavailable_reason():
    """Why the kernel could not be built, or None."""
    return str(_LIB["error"]) if "error" in _LIB else None


def applies(x, weight, bias=None):
    """Whether `product` computes linear(x, weight, bias): one row of float32 or bfloat16 CPU tensors
    (all one dtype), a weight whose rows are dense, no gradient wanted, not inside a compiler or
    exporter (they trace plain ops: compiled steps keep the compiler's own products,
    `linear.WeightPack.in_graph`)."""
    dtype = x.dtype if type(x) is torch.Tensor else None
    if dtype not in _DTYPES or x.device.type != "cpu" or x.dim() == 0:
        return False
    if (weight.dtype != dtype or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(1) != 1
            or x.shape[-1] != weight.shape[1] or x.numel() != x.shape[-1] or 0 in weight.shape
            or (dtype == torch.bfloat16 and weight.shape[1] % 2)):  # bf16 weights are read in pairs
        return False
    if bias is not None and (bias.dtype != dtype or bias.device.type != "cpu" or bias.dim() != 1
                             or bias.stride(0) != 1 or bias.shape[0] != weight.shape[0]):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return not (torch.compiler.is_compiling() or is_exporting() or transformed(x, weight))


def product(x, weight, bias=None):
    """x (..., in) holding one row, weight (out, in), bias (out,) or None -> (..., out) in x's dtype,
    the same as `nn.functional.linear` to float32 rounding (the sum runs in another order; bfloat16
    products are exact in float32 and summed there, as oneDNN's are, then rounded once). Call where
    `applies(x, weight, bias)`; the library must be loaded (`load`)."""
    lib = _LIB["lib"]
    n, k = weight.shape
    threads = torch.get_num_threads()
    if x.dtype == torch.float32:  # decode's hot path (~127 calls a step): read in place, nothing converted
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], n)  # on x's device whatever the default device is
        lib.kvw_gemv_f32(weight.data_ptr(), weight.stride(0), x.data_ptr(), None if bias is None else bias.data_ptr(),
                         out.data_ptr(), n, k, threads)
        return out
    xf = x.reshape(k).float()
    xe, xo = xf[0::2].contiguous(), xf[1::2].contiguous()
    bf = None if bias is None else bias.float()
    out = xf.new_empty(*x.shape[:-1], n)
    lib.kvw_gemv_bf16(weight.data_ptr(), weight.stride(0), xe.data_ptr(), xo.data_ptr(),
                      None if bf is None else bf.data_ptr(), out.data_ptr(), n, k, threads)
    return out.to(x.dtype)


_DTYPES = (torch.float32, torch.bfloat16)
