"""What this CPU computes natively, and the path each kind of product takes on it.

Each choice below is made once a process from the CPU's features, unless its switch
(`switches.TABLE`) names a path; a path this CPU or build cannot take is refused, naming what is
missing. docs/kernels.md explains each choice and the measurements behind it.

- `bf16_gemm`: bfloat16 products of many rows. bf16 is native only with dot-product units
  (AVX512_BF16, AMX): there "packed" (oneDNN's blocked copy of each weight) or "native"; elsewhere
  bf16 is emulated and slower than float32, so "upcast" computes them in float32.
- `f32_gemv`: float32 products of a few rows (decode), memory-bound, and fastest through whichever
  form MKL dispatches well on this CPU: "linear" (x @ W^T) on Intel CPUs with AVX-512, "transposed"
  (W @ x^T) elsewhere.
- `f32_row`: one-row products on kvwire's AVX-512 GEMV (`native/gemv.c`, "kvwire") or through MKL.
- `fused`: a gated MLP's act(gate) * up and RMSNorm in one pass (`native/fused.c`, "kvwire") or as
  PyTorch's ops ("aten").
- `ggml_kernel`: Q4_1, Q5_0, Q8_0, Q4_K and Q6_K blocks on kvwire's x16 kernel or ggml's own.
"""
from functools import lru_cache

import torch

from . import switches

# the paths each choice takes, as its switch names them
BF16_CHOICES = switches.TABLE["KVWIRE_BF16_GEMM"].choices
F32_CHOICES = switches.TABLE["KVWIRE_F32_GEMV"].choices
F32_ROW_CHOICES = switches.TABLE["KVWIRE_F32_ROW"].choices
FUSED_CHOICES = switches.TABLE["KVWIRE_FUSED"].choices
GGML_KERNELS = switches.TABLE["KVWIRE_GGML_KERNEL"].choices


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
    as they are) or 'upcast' (many-row bf16 products run in float32). Set by `KVWIRE_BF16_GEMM`."""
    asked = switches.get("KVWIRE_BF16_GEMM")
    if asked is None:
        if not native_bf16():
            return "upcast"
        return "packed" if torch.backends.mkldnn.is_available() else "native"
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
    AVX-512, else 'transposed' (W @ x^T; also where /proc/cpuinfo is missing). Set by
    `KVWIRE_F32_GEMV`."""
    asked = switches.get("KVWIRE_F32_GEMV")
    if asked is None:
        # only an AVX-512 Xeon was measured faster on 'linear': other Intel CPUs keep 'transposed'
        return "linear" if cpuinfo_field("vendor_id") == "GenuineIntel" and features()["avx512"] else "transposed"
    return asked


def f32_row():
    """'kvwire' (one-row float32 products, and a bfloat16 head's, on kvwire's AVX-512 GEMV,
    `native.gemv`) or 'mkl' (through the `f32_gemv` path; a bf16 head through oneDNN's pack).
    Default: 'kvwire' where `f32_gemv()` is 'linear' and the kernel builds here (a C compiler is
    needed; without one, 'mkl'). `KVWIRE_F32_ROW=kvwire` elsewhere is refused without AVX-512F or a
    working build, naming what is missing. Cached for each `f32_gemv()` answer
    (`f32_row.cache_clear()` after changing `KVWIRE_F32_ROW`)."""
    return _f32_row(f32_gemv())


@lru_cache(maxsize=None)
def _f32_row(gemv_path):
    from .native import gemv  # imported here: it builds nothing until asked

    asked = switches.get("KVWIRE_F32_ROW")
    if asked is None:
        return "kvwire" if gemv_path == "linear" and features()["avx512"] and gemv.available() else "mkl"
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
    kernels build. Set by `KVWIRE_FUSED`; 'kvwire' without AVX-512F or a build is refused, naming what
    is missing."""
    from .native import fused as kernels  # imported here: it builds nothing until asked

    asked = switches.get("KVWIRE_FUSED")
    if asked is None:
        return "kvwire" if features()["avx512"] and kernels.available() else "aten"
    if asked == "kvwire" and not features()["avx512"]:
        raise ValueError("KVWIRE_FUSED=kvwire needs AVX-512F, which this CPU lacks; unset it (gated MLPs and "
                         "RMSNorm then run PyTorch's ops)")
    if asked == "kvwire" and not kernels.available():
        raise ValueError(f"KVWIRE_FUSED=kvwire, but kvwire's fused kernels could not be built here: "
                         f"{kernels.unavailable_reason()}")
    return asked


def ggml_kernel(asked=None, runs=None):
    """The kernel for the formats x16 repacks (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K): `asked` ("x16" / "ggml"), else
    `KVWIRE_GGML_KERNEL`, else 'x16' (kvwire's kernel on repacked blocks) where the CPU runs it for
    some format (all but Q6_K with AVX-512 F, BW, VL and VNNI; Q4_1, Q8_0, Q4_K and Q6_K with AVX2, FMA and
    F16C without VNNI; Q5_0
    stays on ggml's kernels there, `quant.ggml.linear.x16_layout`) and 'ggml' (ggml's kernels
    on the file's layout) where it runs for none. x16 on a CPU without those features is refused,
    naming them. `runs`: whether x16 runs here for some format, when the caller knows without the
    bridge (None: ask the bridge, built on first use)."""
    source = "kernel" if asked is not None else "KVWIRE_GGML_KERNEL"
    if asked is None:
        asked = switches.get("KVWIRE_GGML_KERNEL") or ""
    asked = str(asked).strip().lower()
    if runs is None:
        from .ggml import lib  # imported here: the bridge is built on first use

        runs = lib.x16_runs()
    if not asked:
        return "x16" if runs else "ggml"
    if asked not in GGML_KERNELS:
        raise ValueError(f"{source}={asked!r}; expected one of {', '.join(GGML_KERNELS)}")
    if asked == "x16" and not runs:
        raise ValueError(f"{source}=x16 needs AVX-512 F, BW and VL with AVX512_VNNI, or AVX2 with FMA and F16C, "
                         "which this CPU lacks; "
                         "leave it unset (kvwire then runs ggml's own kernels)")
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
