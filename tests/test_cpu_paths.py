"""Kernel paths chosen by the CPU: bf16 GEMMs stay bf16 where the CPU has bf16 units, and are upcast
to float32 where it has not. Each branch is tested where it runs; the other is skipped."""
import pytest
import torch

from kvwire.layers import cpu
from kvwire.layers.linear import linear


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv("KVWIRE_BF16_GEMM", raising=False)
    cpu.bf16_gemm.cache_clear()
    yield
    cpu.bf16_gemm.cache_clear()


def dtype_reaching_gemm(monkeypatch, rows=128):
    """The dtype that nn.functional.linear receives for a bf16 product of `rows` rows."""
    seen = []
    real = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append(x.dtype)
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    x, w = torch.randn(rows, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16)
    out = linear(x, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), atol=0.5, rtol=0.02)
    return seen[-1]


@pytest.mark.skipif(not cpu.native_bf16(), reason="this CPU has no bf16 units (AVX512_BF16/AMX): native path not run")
def test_bf16_gemm_stays_native_on_a_cpu_with_bf16_units(monkeypatch):
    assert cpu.bf16_gemm() == "native"
    assert dtype_reaching_gemm(monkeypatch) == torch.bfloat16


@pytest.mark.skipif(cpu.native_bf16(), reason="this CPU has bf16 units: the upcast default is not chosen here")
def test_bf16_gemm_is_upcast_on_a_cpu_without_bf16_units(monkeypatch):
    assert cpu.bf16_gemm() == "upcast"
    assert dtype_reaching_gemm(monkeypatch) == torch.float32


def test_the_choice_can_be_forced_to_upcast_anywhere(monkeypatch):
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "upcast")
    assert cpu.bf16_gemm() == "upcast"
    assert dtype_reaching_gemm(monkeypatch) == torch.float32


def test_a_path_the_cpu_cannot_run_is_refused_naming_the_feature(monkeypatch):
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "native")
    with pytest.raises(ValueError, match="needs bfloat16 dot-product units, but this CPU has neither AVX512_BF16 nor AMX"):
        cpu.bf16_gemm()
    cpu.bf16_gemm.cache_clear()
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match=r"KVWIRE_BF16_GEMM='fast'; expected one of native, upcast"):
        cpu.bf16_gemm()


def test_the_report_names_features_and_paths():
    line = cpu.report()
    assert "avx512_bf16" in line and f"bf16 GEMM: {cpu.bf16_gemm()}" in line
    assert all(isinstance(v, bool) for v in cpu.features().values())
