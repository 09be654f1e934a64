"""A gated MLP's act(gate) * up in one pass on kvwire's AVX-512 kernel (`gated.c`), for many-row calls.

Eager PyTorch runs the activation and the product as two ops, and its bfloat16 tanh-GELU is slow:
a 512-token prompt of the default model spends ~19 ms of ~175 in `gelu` and the product after it
(bfloat16, the AMX Xeon kvwire is measured on). `cpu.gated_act()` decides where this kernel is used;
`GatedMLP` calls it for the activations it knows (`KINDS`), at any row count: it wins at one row too
(bfloat16, a (1, 2048) gate: 6.2 against 8.7 us; 4 rows 8.8 against 25.3).

Example:
    >>> g, u = torch.randn(4, 64), torch.randn(4, 64)
    >>> y = product("silu", g, u) if available() else torch.nn.functional.silu(g) * u
    >>> torch.allclose(y, torch.nn.functional.silu(g) * u, atol=1e-6)
    True
"""
import ctypes
from pathlib import Path

import torch

from ..layers.tracing import is_exporting
from .build import BuildError, library

SOURCE = Path(__file__).with_name("gated.c")
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]  # built and called only where the CPU has AVX-512F
KINDS = {"gelu_tanh": 0, "silu": 1}  # gated.c's KVW_GELU_TANH, KVW_SILU
_LIB = {}  # "lib": the loaded library, or "error": why it could not be built


def load():
    """The loaded kernel library, built on first use; raises `BuildError` (remembered: one try a
    process)."""
    if "lib" not in _LIB and "error" not in _LIB:
        try:
            lib = ctypes.PyDLL(str(library("kvw_gated", [SOURCE], FLAGS)))  # after torch: its libgomp serves
        except (BuildError, OSError) as e:
            _LIB["error"] = BuildError(str(e))
        else:
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            for name in ("kvw_gated_f32", "kvw_gated_bf16"):
                getattr(lib, name).argtypes, getattr(lib, name).restype = [i32, p, p, p, i64, i32], None
            _LIB["lib"] = lib
    if "error" in _LIB:
        raise _LIB["error"]
    return _LIB["lib"]


def available():
    """Whether the kernel is built and loaded here (building it if needed); the CPU is not checked."""
    try:
        load()
    except BuildError:
        return False
    return True


def unavailable_reason():
    """Why the kernel could not be built, or None."""
    return str(_LIB["error"]) if "error" in _LIB else None


def applies(gate, up):
    """Whether `product` computes act(gate) * up here: same-shaped, contiguous float32 or bfloat16 CPU
    tensors, no gradient wanted, not inside a compiler or exporter (they fuse the plain ops themselves)."""
    if type(gate) is not torch.Tensor or type(up) is not torch.Tensor:  # subclasses (fake, functional) trace
        return False
    if gate.dtype not in _DTYPES or gate.dtype != up.dtype or gate.shape != up.shape:
        return False
    if gate.device.type != "cpu" or up.device.type != "cpu" or not gate.is_contiguous() or not up.is_contiguous():
        return False
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return False
    return not (torch.compiler.is_compiling() or is_exporting())


def product(kind, gate, up):
    """act(gate) * up for act `kind` ("gelu_tanh": GELU, tanh-approximated; "silu"), gate and up (...)
    -> (...) in their dtype, rounded as PyTorch's two ops round it (bfloat16: act's result, then the
    product). Call where `applies(gate, up)`; the library must be loaded (`load`)."""
    out = torch.empty_like(gate)
    kernel = _LIB["lib"].kvw_gated_f32 if gate.dtype == torch.float32 else _LIB["lib"].kvw_gated_bf16
    kernel(KINDS[kind], gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
    return out


_DTYPES = (torch.float32, torch.bfloat16)
