"""What this CPU computes natively, and the matmul paths kvwire chooses from it.

bfloat16 GEMM with many rows is native where the CPU has bf16 dot-product units (AVX512_BF16, or
AMX): oneDNN then runs it at about twice float32's speed, and faster still on a weight kept in
oneDNN's own blocked layout ("packed": `linear.WeightPack`, a second copy of each bf16 weight; the
default there). Without them bf16 is emulated and several times slower than float32, so there
many-row bf16 products are computed in float32 from upcast weights ("upcast"). `KVWIRE_BF16_GEMM`
(`packed` / `native` / `upcast`) overrides the choice ("native": bf16 products on the weights as
they are, no second copy); `packed` or `native` on a CPU without bf16 units is refused, naming the
missing feature.
"""
import os
from functools import lru_cache

import torch

BF16_CHOICES = ("packed", "native", "upcast")


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


def features_text(found=None):
    """`found` (default: `features()`) as "avx2+ avx512- ...": + where present."""
    return " ".join(f"{name}{'+' if on else '-'}" for name, on in (found or features()).items())


def report():
    """One line for benchmark headers: the features and the paths chosen."""
    return f"CPU features: {features_text()}; bf16 GEMM: {bf16_gemm()}; torch CPU capability: " \
           f"{torch.backends.cpu.get_cpu_capability()}"
