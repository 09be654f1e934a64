"""kvwire's one-pass kernels (`kvwire/kernels/native/fused.c`): a gated MLP's act(gate) * up and RMSNorm, their
values against float64 references and PyTorch's ops (tanh-GELU and SiLU, float32 and bfloat16, every
tail length, special values), the choice `cpu.fused()` makes and what it refuses, where `GatedMLP` and
`RMSNorm` use them and where they leave the call to PyTorch (edits, gradients, transforms, layouts).
Kernel tests run where the CPU has AVX-512F and the kernels build; elsewhere they are skipped with the
reason."""
import pytest
import torch
import torch.nn.functional as F

import kvwire as kw
from kvwire.kernels import cpu
from kvwire.layers.mlp import GatedMLP
from kvwire.layers.norm import RMSNorm
from kvwire.kernels.native import fused

from .conftest import FAMILIES

NO_AVX512 = "this CPU has no AVX-512F: kvwire's fused kernels do not run here"
runs_here = pytest.mark.skipif(not cpu.features()["avx512"] or not fused.available(),
                               reason=NO_AVX512 if not cpu.features()["avx512"] else
                               f"kvwire's fused kernels did not build here: {fused.unavailable_reason()}")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv("KVWIRE_FUSED", raising=False)
    cpu.fused.cache_clear()
    yield
    cpu.fused.cache_clear()


def exact(kind, gate):
    """act(gate) in float64, as x * sigmoid(z): 0.5 x (1 + tanh(y)) cancels for x below about -3."""
    x = gate.double()
    return x * torch.sigmoid(_z(kind, x))


def _z(kind, x):
    return x if kind == "silu" else 2 * 0.7978845608028654 * (x + 0.044715 * x ** 3)


@runs_here
@pytest.mark.parametrize("kind", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 4096 + 33, 3 * 2048])
def test_float32_values_are_within_a_few_ulp_of_float64(kind, n):
    torch.manual_seed(n)
    gate, up = torch.randn(n) * 4, torch.randn(n)
    y = fused.gated(kind, gate, up)
    reference = exact(kind, gate) * up.double()
    # a few ulp of act (e^-z from a polynomial) and the product's; and z's own float32 rounding, which
    # e^-z turns into |z| ulp (PyTorch's GELU is off by up to 2^23 ulp there: 1 + tanh cancels); 1e-30
    # absolute where act underflows (x below about -13 for GELU)
    z = _z(kind, gate.double()).abs()
    bound = (8 + 2 * z) * torch.finfo(torch.float32).eps * reference.abs() + 1e-30
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert ((y.double() - reference).abs() <= bound).all()


@runs_here
@pytest.mark.parametrize("kind", ["gelu_tanh", "silu"])
def test_bfloat16_values_are_the_exact_acts_rounded_then_the_products(kind):
    """act(gate) rounded to bfloat16, then the product rounded: act is the exact act's rounding for all
    but a few values a few float32 ulp from a rounding boundary (then the next bfloat16), and the
    product is exactly that act times up, rounded."""
    torch.manual_seed(0)
    gate, up = (torch.randn(512, 2048) * 4).bfloat16(), torch.randn(512, 2048).bfloat16()
    act = fused.gated(kind, gate, torch.ones_like(up))
    rounded = exact(kind, gate).bfloat16()
    # measured: 0.12 % for GELU (x below -3, where e^-z turns z's rounding into up to 90 ulp), 0 for SiLU
    assert (act != rounded).float().mean() < 2e-3
    neighbours = (act.view(torch.int16).int() - rounded.view(torch.int16).int()).abs() <= 1
    # (0 == -0); 0 where the exact act is below 1e-36 (GELU below x = -10: e^-z overflows float32 first)
    assert (neighbours | (act == rounded) | (rounded.float().abs() < 1e-36)).all()
    assert torch.equal(fused.gated(kind, gate, up), (act.double() * up.double()).bfloat16())


@runs_here
def test_special_values_come_out_as_pytorchs():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -200.0, 200.0, 1.5] * 3)
    for dtype in (torch.float32, torch.bfloat16):
        g, u = x.to(dtype), torch.ones_like(x, dtype=dtype)
        for kind, act in (("gelu_tanh", lambda v: F.gelu(v, approximate="tanh")), ("silu", F.silu)):
            y, want = fused.gated(kind, g, u), act(g)
            assert torch.equal(y.isnan(), want.isnan()), (kind, dtype)
            assert torch.equal(y[~want.isnan()], want[~want.isnan()]), (kind, dtype)
            assert torch.equal(y.signbit(), want.signbit()) or kind == "gelu_tanh" and dtype == torch.float32


@runs_here
def test_values_do_not_depend_on_the_thread_count():
    gate, up = torch.randn(3, 5000).bfloat16(), torch.randn(3, 5000).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.gated("gelu_tanh", gate, up)
        torch.set_num_threads(2)
        assert torch.equal(fused.gated("gelu_tanh", gate, up), one)
    finally:
        torch.set_num_threads(threads)


def _calls(monkeypatch):
    calls = []
    real = fused.gated
    monkeypatch.setattr(fused, "gated", lambda kind, g, u: calls.append((kind, g.dtype, tuple(g.shape))) or
                        real(kind, g, u))
    return calls


@runs_here
@pytest.mark.parametrize("act, kind", [("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"),
                                       ("silu", "silu"), ("swish", "silu")])
def test_a_gated_mlp_runs_its_activation_and_product_in_one_pass(monkeypatch, act, kind):
    mlp = GatedMLP(64, 128, act=act).bfloat16()
    x = torch.randn(2, 5, 64).bfloat16()
    calls = _calls(monkeypatch)
    with torch.no_grad():
        y = mlp(x)
        monkeypatch.setenv("KVWIRE_FUSED", "aten")
        cpu.fused.cache_clear()
        two_ops = mlp(x)
    assert calls == [(kind, torch.bfloat16, (2, 5, 128))]
    assert torch.allclose(y.float(), two_ops.float(), rtol=2 ** -7, atol=1e-3)


@runs_here
def test_what_the_kernel_does_not_compute_runs_as_it_is(monkeypatch):
    """An activation replaced by an edit, exact GELU, a gradient wanted, float16: PyTorch's ops."""
    calls = _calls(monkeypatch)
    mlp = GatedMLP(64, 128, act="gelu_pytorch_tanh")
    x = torch.randn(3, 64)
    mlp.act = lambda v: F.gelu(v, approximate="tanh") * 2  # an edit: no longer the function the kernel knows
    with torch.no_grad():
        assert torch.equal(mlp(x), mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x)))
    with torch.no_grad():
        GatedMLP(64, 128, act="gelu")(x)  # exact (erf) GELU
    GatedMLP(64, 128, act="silu").requires_grad_(False)(x.clone().requires_grad_())  # the input's gradient
    with torch.no_grad():
        GatedMLP(64, 128, act="silu").half()(x.half())
    assert calls == []


def _norm_reference(x, weight, eps, offset):
    x = x.double()
    h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (1 + weight.double()) if offset else h * weight.double()


@runs_here
@pytest.mark.parametrize("offset", [True, False], ids=["gemma", "llama"])
@pytest.mark.parametrize("shape", [(1, 1, 640), (2, 7, 640), (1, 512, 4, 256), (3, 64), (0, 32)])
def test_rms_norm_values(offset, shape):
    """float32: within a few ulp of float64; bfloat16: float64's value rounded once, but for values a few
    float32 ulp from a rounding boundary (then the neighbouring bfloat16)."""
    torch.manual_seed(len(shape))
    x, weight = torch.randn(*shape) * 3, torch.randn(shape[-1]) * 0.5
    reference = _norm_reference(x, weight, 1e-6, offset)
    y = fused.rms_norm(x, weight, 1e-6, offset)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert ((y.double() - reference).abs() <= 8 * torch.finfo(torch.float32).eps * reference.abs() + 1e-30).all()
    xb, wb = x.bfloat16(), weight.bfloat16()
    yb = fused.rms_norm(xb, wb, 1e-6, offset)
    rounded = _norm_reference(xb, wb, 1e-6, offset).bfloat16()
    assert yb.dtype == torch.bfloat16 and (yb != rounded).sum() <= 1e-3 * yb.numel()
    neighbours = (yb.view(torch.int16).int() - rounded.view(torch.int16).int()).abs() <= 1
    assert (neighbours | (yb == rounded)).all()  # 0 == -0 (a weight of -1 with the offset)


@runs_here
def test_rms_norm_values_do_not_depend_on_the_thread_count():
    x, weight = torch.randn(64, 640).bfloat16(), torch.randn(640).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.rms_norm(x, weight, 1e-6, True)
        torch.set_num_threads(2)
        assert torch.equal(fused.rms_norm(x, weight, 1e-6, True), one)
        assert torch.equal(fused.rms_norm(x[5:6], weight, 1e-6, True), one[5:6])  # a row alone: the same
    finally:
        torch.set_num_threads(threads)


@runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_rms_norm_layer_runs_in_one_pass_as_its_ops_compute(monkeypatch, dtype):
    calls = []
    real = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    norm = RMSNorm(256, 1e-6, offset=True).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(1, 9, 4, 256) * 2).to(dtype)
    with torch.no_grad():
        y = norm(x)
        monkeypatch.setenv("KVWIRE_FUSED", "aten")
        cpu.fused.cache_clear()
        ops = norm(x)
    assert calls == [(1, 9, 4, 256)]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    assert y.dtype == ops.dtype == dtype and torch.allclose(y.float(), ops.float(), **tol)


@runs_here
def test_norms_the_kernel_does_not_take_run_their_ops(monkeypatch):
    """A width that is not a multiple of 16, float32 x with bfloat16 weights, a gradient wanted."""
    calls = []
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(a))
    with torch.no_grad():
        RMSNorm(40)(torch.randn(2, 40))
        RMSNorm(64).bfloat16()(torch.randn(2, 64))
    RMSNorm(64).requires_grad_(False)(torch.randn(2, 64, requires_grad=True))  # the input's gradient
    with torch.no_grad():
        RMSNorm(64)(torch.randn(64, 2).T)  # not contiguous
    assert calls == []


@runs_here
def test_transforms_and_forward_mode_ad_get_pytorchs_ops():
    """vmap and jvp wrap tensors without storage; a dual tensor's tangent would be dropped: the layers
    leave all three to PyTorch, and the tangents come out as PyTorch's."""
    import torch.autograd.forward_ad as fwAD

    norm, mlp = RMSNorm(64).requires_grad_(False), GatedMLP(64, 128, act="silu").requires_grad_(False)
    x, t = torch.randn(3, 64), torch.randn(3, 64)
    for layer in (norm, mlp):
        assert torch.allclose(torch.vmap(layer)(x), layer(x), atol=1e-6)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t))).tangent
        assert tangent is not None
        assert torch.allclose(tangent, torch.func.jvp(layer, (x,), (t,))[1], atol=1e-5)


@runs_here
def test_direct_calls_with_tensors_the_kernels_cannot_read_are_refused():
    with pytest.raises(ValueError, match=r"fused.gated: expected contiguous gate and up of one shape and dtype .*"
                                         r"got \(4, 64\) torch.float32 and \(4, 32\) torch.float32"):
        fused.gated("silu", torch.randn(4, 64), torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"fused.rms_norm: .*D a multiple of 16; got \(2, 40\) torch.float32"):
        fused.rms_norm(torch.randn(2, 40), torch.randn(40), 1e-6, True)
    with pytest.raises(ValueError, match="fused.rms_norm"):
        fused.rms_norm(torch.randn(2, 64).bfloat16(), torch.randn(64), 1e-6, True)


def test_the_kernel_sources_ship_in_the_package():
    """Every C source kvwire compiles on first use is package data (an installed wheel without it
    would quietly fall back to PyTorch's ops)."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    import kvwire

    root = Path(kvwire.__file__).parent
    data = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for source in [*root.rglob("*.c"), *root.rglob("*.cpp")]:
        package = ".".join(source.parent.relative_to(root.parent).parts)
        assert any(fnmatch(source.name, pattern) for pattern in data.get(package, [])), source


@runs_here
@pytest.mark.parametrize("family, dtype", [("gemma3", torch.float32), ("llama", torch.bfloat16)])
def test_a_model_generates_the_same_tokens_through_the_kernels(monkeypatch, family, dtype):
    """Gemma 3 (GeGLU, (1 + w) norms) in float32, Llama (SwiGLU) in bfloat16: greedy tokens as through
    PyTorch's ops."""
    lm = kw.from_hf(FAMILIES[family]()).to(dtype)
    ids = torch.tensor([[3, 17, 42, 9, 55, 23]])
    norms = []
    real = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda x, *a: norms.append(1) or real(x, *a))
    mlps = _calls(monkeypatch)
    kernels = lm.generate(ids, max_new_tokens=8, ignore_eos=True, return_logprobs=True).tokens
    assert len(mlps) >= lm.config.num_hidden_layers and len(norms) >= 2 * lm.config.num_hidden_layers
    monkeypatch.setenv("KVWIRE_FUSED", "aten")
    cpu.fused.cache_clear()
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True, return_logprobs=True).tokens == kernels


def test_the_choice_follows_the_cpu_and_can_be_forced(monkeypatch):
    assert cpu.fused() == ("kvwire" if cpu.features()["avx512"] and fused.available() else "aten")
    assert f"gated MLP and RMSNorm kernels: {cpu.fused()};" in cpu.report()
    monkeypatch.setenv("KVWIRE_FUSED", "aten")
    cpu.fused.cache_clear()
    assert cpu.fused() == "aten"
    monkeypatch.setenv("KVWIRE_FUSED", "fused")
    cpu.fused.cache_clear()
    with pytest.raises(ValueError, match=r"KVWIRE_FUSED='fused'; expected one of kvwire, aten"):
        cpu.fused()


def test_the_kernel_is_refused_on_a_cpu_without_avx512(monkeypatch):
    found = {**cpu.features(), "avx512": False}
    monkeypatch.setattr(cpu, "features", lambda: found)
    assert cpu.fused() == "aten"
    monkeypatch.setenv("KVWIRE_FUSED", "kvwire")
    cpu.fused.cache_clear()
    with pytest.raises(ValueError, match="KVWIRE_FUSED=kvwire needs AVX-512F, which this CPU lacks"):
        cpu.fused()
