"""One-pass elementwise kernels on AVX-512 (`fused.c`): a gated MLP's act(gate) * up, and RMSNorm.

Eager PyTorch makes a pass and a temporary per step (bfloat16 converted to float32 and back around
each): a gated MLP's activation, then its product; an RMSNorm's upcast, squares, mean, scale, weight
and downcast. `cpu.fused()` decides where these kernels are used; `GatedMLP` and `RMSNorm` call them at
any row count (docs/kernels.md, Measurements).

Example:
    >>> from kvwire.kernels import cpu
    >>> g, u = torch.randn(4, 64), torch.randn(4, 64)
    >>> y = gated("silu", g, u) if cpu.fused() == "kvwire" else torch.nn.functional.silu(g) * u
    >>> torch.allclose(y, torch.nn.functional.silu(g) * u, atol=1e-6)
    True
"""
import ctypes
from pathlib import Path

import torch

from ..build import builds, library, loaded
from ..tracing import is_exporting, transformed

SOURCE = Path(__file__).with_name("fused.c")
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]  # built and called only where the CPU has AVX-512F
KINDS = {"gelu_tanh": 0, "silu": 1}  # fused.c's KVW_GELU_TANH, KVW_SILU
_DTYPES = (torch.float32, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not fake, functional or other tensor subclasses
_LIB = {}  # "lib": the loaded library, or "error": why it could not be built


def load():
    """The loaded kernel library, built on first use; raises `BuildError` (remembered: one try a
    process)."""
    return loaded(_LIB, lambda: library("kvw_fused", [SOURCE], FLAGS), _declare)


def _declare(lib):
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("kvw_gated_f32", "kvw_gated_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [i32, p, p, p, i64, i32], None
    lib.kvw_rms_norm.argtypes, lib.kvw_rms_norm.restype = [p, p, p, i64, i64, ctypes.c_float, i32, i32, i32], None


def available():
    """Whether the kernels are built and loaded here (building them if needed); the CPU is not checked.
    `unavailable_reason()` says why not."""
    return builds(load)


def unavailable_reason():
    return str(_LIB["error"]) if "error" in _LIB else None


def _plain(*tensors):
    """Contiguous float32 or bfloat16 CPU tensors of one dtype, no gradient wanted, outside compilers,
    exporters (they fuse the plain ops themselves; fake and functional tensors are subclasses),
    functorch transforms and forward-mode AD."""
    if any(type(t) not in _PLAIN for t in tensors):
        return False
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
                                   for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not (torch.compiler.is_compiling() or is_exporting() or transformed(*tensors))


def applies_gated(gate, up):
    """Whether `gated` computes act(gate) * up here (same shapes, see `_plain`)."""
    return _plain(gate, up) and gate.shape == up.shape


def gated(kind, gate, up):
    """act(gate) * up for act `kind` ("gelu_tanh": GELU, tanh-approximated; "silu"), gate and up (...)
    -> (...) in their dtype, rounded where PyTorch's two ops round (bfloat16: act's result, then the
    product; act itself is closer to the exact value than PyTorch's below x = -3, see fused.c). Call
    where `applies_gated(gate, up)`; the library must be loaded (`load`)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in _DTYPES or \
            not (gate.is_contiguous() and up.is_contiguous()):  # the kernel reads both unchecked
        raise ValueError(f"fused.gated: expected contiguous gate and up of one shape and dtype (float32 or "
                         f"bfloat16), got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    out = torch.empty_like(gate)
    kernel = _LIB["lib"].kvw_gated_f32 if gate.dtype == torch.float32 else _LIB["lib"].kvw_gated_bf16
    kernel(KINDS[kind], gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
    return out


def applies_rms_norm(x, weight):
    """Whether `rms_norm` computes RMSNorm of x with weight here: x (..., D) and weight (D,) of one dtype,
    D a multiple of 16 (see `_plain`)."""
    return _plain(x, weight) and x.dim() >= 1 and weight.dim() == 1 and x.shape[-1] == weight.shape[0] and \
        weight.shape[0] % 16 == 0 and weight.shape[0] > 0


def rms_norm(x, weight, eps, offset):
    """x (..., D) / sqrt(mean(x^2) + eps) * weight (D,) (`offset`: * (1 + weight)), computed in float32
    and rounded once to x's dtype: kvwire's `RMSNorm`. Call where `applies_rms_norm(x, weight)`; the
    library must be loaded (`load`)."""
    if x.dim() < 1 or weight.shape != x.shape[-1:] or x.shape[-1] % 16 or weight.dtype != x.dtype or \
            x.dtype not in _DTYPES or not (x.is_contiguous() and weight.is_contiguous()):  # read unchecked
        raise ValueError(f"fused.rms_norm: expected contiguous x (..., D) and weight (D,) of one dtype (float32 or "
                         f"bfloat16), D a multiple of 16; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    out = torch.empty_like(x)
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    _LIB["lib"].kvw_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, x.shape[-1], float(eps),
                             int(bool(offset)), int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out
