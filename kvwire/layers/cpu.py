"""What this CPU computes natively, and the matmul paths kvwire chooses from it.

bfloat16 GEMM with many rows is native where the CPU has bf16 dot-product units (AVX512_BF16, or
AMX): oneDNN then runs it at about twice float32's speed, and faster still on a weight kept in
oneDNN's own blocked layout ("packed": `linear.WeightPack`, a second copy of each bf16 weight; the
default there). Without them bf16 is emulated and several times slower than float32, so there
many-row bf16 products are computed in float32 from upcast weights ("upcast"). `KVWIRE_BF16_GEMM`
(`packed` / `native` / `upcast`) overrides the choice ("native": bf16 products on the weights as
they are, no second copy); `packed` or `native` on a CPU without bf16 units is refused, naming the
missing feature.

Float32 products of a few rows (decode) are memory-bound GEMVs whose speed depends on how MKL
dispatches on the CPU: on Intel CPUs with AVX-512 `nn.functional.linear` (x @ W^T) streams the
weights fastest ("linear"; batched decode, 2-64 rows, reads packed copies: `linear.WeightPack`);
elsewhere (AMD, where MKL takes generic code paths, and the machines not measured) W @ x^T is
1.5-4x faster, with one row repeated for wide or square weights and an
MKL-packed copy of the head at batch 1 ("transposed", `linear.linear`). `KVWIRE_F32_GEMV`
(`linear` / `transposed`) overrides the choice; both give the same values (to float32 rounding)
on any CPU. On the "linear" path one-row products (batch-1 decode) go to kvwire's own AVX-512 GEMV
(`native/gemv.c`, built with the machine's C compiler on first use), which streams the weights faster
than MKL's `linear` there (`f32_row`; `KVWIRE_F32_ROW` = `kvwire` / `mkl` overrides).

A gated MLP's act(gate) * up and RMSNorm run in one pass on kvwire's AVX-512 kernels
(`native/fused.c`) where the CPU has AVX-512F, else as PyTorch's ops (`fused`; `KVWIRE_FUSED` =
`kvwire` / `aten` overrides).
"""
import os
from functools import lru_cache

import torch

BF16_CHOICES = ("packed", "native", "upcast")
F32_CHOICES = ("linear", "transposed")
F32_ROW_CHOICES = ("kvwire", "mkl")
FUSED_CHOICES = ("kvwire", "aten")


@lru_cache(maxsize=None)
def features():
    """{feature: bool} of what torch's CPU kernels can use here."""
    cpu = torch.cpu
    probe = lambda name: bool(getattr(cpu, name, lambda: False)())  # noqa: E731 - older torch lacks some
    return {"avx2": probe("_is_avx2_supported"), "avx512": probe("_is_avx512_supported"),
            "avx512_vnni": probe("_is_vnni_supported"), "avx512_bf16": probe("_is_avx512_bf16_supported"),
            "amx_tile": probe("_is_amx_tile_supported"), "amx_fp16": probe("_is_amx_fp16_supported")}


def native_bf16():
    """Whether this CPU has bfloat16 dot-product units (AVX512_BF16 or AMX)."""
    f = features()
    return f["avx512_bf16"] or f["amx_tile"]


@lru_cache(maxsize=None)
def bf16_gemm():
    """'packed' (bf16 GEMMs stay bf16, on oneDNN-packed weight copies), 'native' (bf16, on the weights
    as they are) or 'upcast' (many-row bf16 products run in float32)."""
    asked = os.environ.get("KVWIRE_BF16_GEMM", "").strip().lower()
    if not asked:
        if not native_bf16():
            return "upcast"
        return "packed" if torch.backends.mkldnn.is_available() else "native"
    if asked not in BF16_CHOICES:
        raise ValueError(f"KVWIRE_BF16_GEMM={asked!r}; expected one of {', '.join(BF16_CHOICES)}")
    if asked != "upcast" and not native_bf16():
        raise ValueError(f"KVWIRE_BF16_GEMM={asked} needs bfloat16 dot-product units, but this CPU has neither "
                         "AVX512_BF16 nor AMX; unset it (kvwire then upcasts many-row bf16 products to float32)")
    if asked == "packed" and not torch.backends.mkldnn.is_available():
        raise ValueError("KVWIRE_BF16_GEMM=packed needs oneDNN, which this torch build lacks "
                         "(torch.backends.mkldnn.is_available() is False); use native")
    return asked


@lru_cache(maxsize=None)
def f32_gemv():
    """'linear' (few-row float32 products through `nn.functional.linear`) on Intel CPUs with
    AVX-512, else 'transposed' (W @ x^T; also where /proc/cpuinfo is missing). Measured (README,
    session 23): an Intel Xeon with AMX decoded the default model at 16.9 against 11.0 tokens/s with 'linear',
    an AMD EPYC (Zen 4) at 1.44x transformers with 'transposed', where transformers' `linear` is slow."""
    asked = os.environ.get("KVWIRE_F32_GEMV", "").strip().lower()
    if not asked:
        # only the AVX-512 Xeon was measured: other Intel CPUs keep the path they had
        return "linear" if cpuinfo_field("vendor_id") == "GenuineIntel" and features()["avx512"] else "transposed"
    if asked not in F32_CHOICES:
        raise ValueError(f"KVWIRE_F32_GEMV={asked!r}; expected one of {', '.join(F32_CHOICES)}")
    return asked


def f32_row():
    """'kvwire' (one-row float32 products, and a bfloat16 head's, on kvwire's AVX-512 GEMV,
    `native.gemv`) or 'mkl' (through the `f32_gemv` path; a bf16 head through oneDNN's pack).
    Default: 'kvwire' where `f32_gemv()` is 'linear' (an Intel CPU with AVX-512: the one measured, session 26: batch-1 float32 decode 21.48 -> 23.23 tokens/s) and the kernel
    builds here (a C compiler is needed; without one, 'mkl'). `KVWIRE_F32_ROW=kvwire` elsewhere is
    refused without AVX-512F or a working build, naming what is missing. Cached for each `f32_gemv()`
    answer (`f32_row.cache_clear()` after changing `KVWIRE_F32_ROW`)."""
    return _f32_row(f32_gemv())


@lru_cache(maxsize=None)
def _f32_row(gemv_path):
    from ..native import gemv  # imported here: it builds nothing until asked

    asked = os.environ.get("KVWIRE_F32_ROW", "").strip().lower()
    if not asked:
        return "kvwire" if gemv_path == "linear" and features()["avx512"] and gemv.available() else "mkl"
    if asked not in F32_ROW_CHOICES:
        raise ValueError(f"KVWIRE_F32_ROW={asked!r}; expected one of {', '.join(F32_ROW_CHOICES)}")
    if asked == "kvwire" and not features()["avx512"]:
        raise ValueError("KVWIRE_F32_ROW=kvwire needs AVX-512F, which this CPU lacks; unset it (one-row float32 "
                         "products then go through MKL)")
    if asked == "kvwire" and not gemv.available():
        raise ValueError(f"KVWIRE_F32_ROW=kvwire, but kvwire's GEMV could not be built here: {gemv.unavailable_reason()}")
    return asked


f32_row.cache_clear = _f32_row.cache_clear


@lru_cache(maxsize=None)
def fused():
    """'kvwire' (a gated MLP's act(gate) * up, for tanh-GELU and SiLU, and RMSNorm, each in one pass on
    `native.fused`) or 'aten' (PyTorch's ops). Default: 'kvwire' where the CPU has AVX-512F and the
    kernels build (bfloat16, a (512, 2048) GELU gate: 0.38 against 1.12 ms; session 30). Set by
    `KVWIRE_FUSED`; 'kvwire' without AVX-512F or a build is refused, naming what is missing."""
    from ..native import fused as kernels  # imported here: it builds nothing until asked

    asked = os.environ.get("KVWIRE_FUSED", "").strip().lower()
    if not asked:
        return "kvwire" if features()["avx512"] and kernels.available() else "aten"
    if asked not in FUSED_CHOICES:
        raise ValueError(f"KVWIRE_FUSED={asked!r}; expected one of {', '.join(FUSED_CHOICES)}")
    if asked == "kvwire" and not features()["avx512"]:
        raise ValueError("KVWIRE_FUSED=kvwire needs AVX-512F, which this CPU lacks; unset it (gated MLPs and "
                         "RMSNorm then run PyTorch's ops)")
    if asked == "kvwire" and not kernels.available():
        raise ValueError(f"KVWIRE_FUSED=kvwire, but kvwire's fused kernels could not be built here: "
                         f"{kernels.unavailable_reason()}")
    return asked


def cpuinfo_field(key, cpuinfo="/proc/cpuinfo"):
    """The first value of `key` in /proc/cpuinfo ("vendor_id", "model name"), or None (not Linux,
    unreadable, no such key)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def features_text(found=None):
    """`found` (default: `features()`) as "avx2+ avx512- ...": + where present."""
    return " ".join(f"{name}{'+' if on else '-'}" for name, on in (found or features()).items())


def report():
    """One line for benchmark headers: the features and the paths chosen."""
    return f"CPU features: {features_text()}; bf16 GEMM: {bf16_gemm()}; float32 GEMV: {f32_gemv()}; " \
           f"one-row kernel (float32, bf16 head): {f32_row()}; gated MLP and RMSNorm kernels: {fused()}; " \
           f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"
