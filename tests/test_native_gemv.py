"""kvwire's AVX-512 GEMV for one-row float32 and bfloat16 products (`kvwire/kernels/native/gemv.c`): the values of
`nn.functional.linear`, the choice `cpu.f32_row()` makes and what it refuses, and a build that fails
(no compiler, a broken source) leaving the MKL path. Kernel tests run where the CPU has AVX-512F and
the kernel builds; elsewhere they are skipped with the reason."""
import pytest
import torch

from kvwire.kernels import cpu
from kvwire.kernels import build
from kvwire.kernels.native import gemv

NO_AVX512 = "this CPU has no AVX-512F: kvwire's GEMV does not run here"
runs_here = pytest.mark.skipif(not cpu.features()["avx512"] or not gemv.available(),
                               reason=NO_AVX512 if not cpu.features()["avx512"] else
                               f"kvwire's GEMV did not build here: {gemv.unavailable_reason()}")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    for name in ("KVWIRE_F32_GEMV", "KVWIRE_F32_ROW"):
        monkeypatch.delenv(name, raising=False)
    cpu.f32_gemv.cache_clear()
    cpu.f32_row.cache_clear()
    yield
    cpu.f32_gemv.cache_clear()
    cpu.f32_row.cache_clear()


@runs_here
@pytest.mark.parametrize("out_features, in_features", [(1, 16), (4, 64), (17, 640), (262, 33), (5, 7), (9, 80),
                                                       (2048, 640), (640, 2048), (3, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gemv_gives_linears_values(out_features, in_features, bias):
    """Every block/tail case (rows not a multiple of 4, widths not a multiple of 64 or 16), as close
    to the float64 product as `linear` is (the sums run in another order, so the bits differ)."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    for x in (torch.randn(1, in_features, generator=g), torch.randn(1, 1, in_features, generator=g),
              torch.randn(in_features, generator=g)):
        assert gemv.applies(x, w, b)
        out = gemv.product(x, w, b)
        assert out.shape == x.shape[:-1] + (out_features,)
        exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        mkl_error = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max().item()
        assert (out.double() - exact).abs().max().item() <= 2 * mkl_error + 1e-6, (out_features, in_features)


@runs_here
@pytest.mark.parametrize("out_features, in_features", [(1, 16), (4, 64), (17, 640), (262, 34), (5, 6), (9, 80),
                                                       (7, 200), (13, 130), (2048, 640), (640, 2048), (3, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16_gemv_gives_linears_values(out_features, in_features, bias):
    """bfloat16 weights (every block and tail case: 128- and 32-weight steps, pairs after them, rows
    not a multiple of 4): the float32 sum of exact products, rounded once to bfloat16, so within one
    bfloat16 step of the float64 product (oneDNN's bf16 `linear` is held to the same)."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    for x in (torch.randn(1, in_features, generator=g), torch.randn(1, 1, in_features, generator=g)):
        x = x.bfloat16()
        assert gemv.applies(x, w, b)
        out = gemv.product(x, w, b)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape[:-1] + (out_features,)
        exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        # one bfloat16 step (8 significant bits) at each value, or float32 summation's error where the
        # sum cancels to near zero
        scale = torch.nn.functional.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
        step = torch.maximum(exact.abs() * 2.0 ** -7, scale * 2.0 ** -20)
        for got in (out, torch.nn.functional.linear(x, w, b)):
            assert bool(((got.double() - exact).abs() <= step).all()), (out_features, in_features)
    wide = torch.randn(out_features, in_features + 6, generator=g).bfloat16()
    w = wide[:, :in_features]  # rows apart: read in place
    x = torch.randn(1, in_features, generator=g).bfloat16()
    assert gemv.applies(x, w)
    torch.testing.assert_close(gemv.product(x, w), gemv.product(x, w.contiguous()), atol=0, rtol=0)


@runs_here
def test_rows_apart_strided_inputs_and_thread_counts():
    """A weight whose rows are a view of a wider one is read in place; a strided x is made dense; one
    and two threads give the same bits, float32 and bfloat16 (blocks go to threads in order: a row's
    sum never depends on how many there are)."""
    g = torch.Generator().manual_seed(0)
    wide, x = torch.randn(300, 200, generator=g), torch.randn(1, 400, generator=g)[:, ::2]
    w = wide[:, :200 - 8]
    x = x[:, :192]
    assert w.stride(0) == 200 and not x.is_contiguous() and gemv.applies(x, w)
    torch.testing.assert_close(gemv.product(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
    threads = torch.get_num_threads()
    for x, w in ((x, w), (x.bfloat16(), w.bfloat16())):
        try:
            torch.set_num_threads(1)
            one = gemv.product(x, w)
            torch.set_num_threads(2)
            two = gemv.product(x, w)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two), x.dtype


@runs_here
def test_the_output_is_made_on_the_inputs_device_whatever_the_default():
    """Under `torch.device("meta")` a factory call without device= makes a meta tensor (no memory):
    the kernel writing there crashed the process. Its output follows x."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(33, 80, generator=g), torch.randn(1, 80, generator=g)
    with torch.device("meta"):
        out = gemv.product(x, w)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x @ w.t(), atol=1e-5, rtol=1e-5)


def test_what_the_gemv_does_not_take():
    """Products it does not compute go elsewhere (`applies` is False): several rows, other dtypes,
    a weight whose columns are strided, sizes that do not match (linear then raises its own error),
    a wanted gradient."""
    w, x = torch.randn(8, 16), torch.randn(1, 16)
    assert gemv.applies(x, w) and gemv.applies(x, w, torch.zeros(8))
    assert not gemv.applies(torch.randn(2, 16), w)
    assert not gemv.applies(x.double(), w.double())
    assert gemv.applies(x.bfloat16(), w.bfloat16())
    assert not gemv.applies(torch.randn(1, 15).bfloat16(), torch.randn(8, 15).bfloat16())  # bf16 read in pairs
    assert not gemv.applies(x.bfloat16(), w)  # mixed dtypes
    assert not gemv.applies(x.half(), w.half())
    assert not gemv.applies(x, torch.randn(16, 8).t())  # columns 8 floats apart
    assert not gemv.applies(torch.randn(1, 15), w)
    assert not gemv.applies(x, w, torch.zeros(7))
    assert not gemv.applies(x, w, torch.zeros(8, dtype=torch.float64))
    with torch.enable_grad():  # whatever mode the test before left
        assert not gemv.applies(x.requires_grad_(), w)
    with torch.no_grad():
        assert gemv.applies(x, w)


@runs_here
def test_a_model_decodes_the_same_tokens_on_the_gemv_and_on_mkl(monkeypatch):
    """A tiny Gemma 3 in float32, batch 1: kvwire's GEMV is called for its one-row products and gives
    the tokens and log-probs of the same model through MKL."""
    from .test_devices import tiny_lm

    monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")  # the path it is used on
    calls, real = [], gemv.product
    monkeypatch.setattr(gemv, "product", lambda x, w, b=None: calls.append(w.shape) or real(x, w, b))
    lm = tiny_lm("gemma3")
    runs = {}
    for row in ("mkl", "kvwire"):
        monkeypatch.setenv("KVWIRE_F32_ROW", row)
        cpu.f32_gemv.cache_clear()
        cpu.f32_row.cache_clear()
        calls.clear()
        runs[row] = lm.generate(["Hello there"], max_new_tokens=8, ignore_eos=True, return_logprobs=True)
        assert bool(calls) == (row == "kvwire"), (row, len(calls))
    assert (lm.head.weight.shape in calls) and len(calls) > 8  # the head and the projections, every step
    assert runs["kvwire"].tokens == runs["mkl"].tokens
    torch.testing.assert_close(runs["kvwire"].logprobs, runs["mkl"].logprobs, atol=1e-4, rtol=1e-4)


@runs_here
def test_a_bf16_models_head_reads_the_gemv_at_one_row(monkeypatch):
    """A tiny Gemma 3 in bfloat16, batch 1: the head's one-row products (the prompt's last row, every
    decode step) go to kvwire's GEMV, no packed copy is made, and the log-probs match the same model
    through oneDNN / `linear`; projections keep their own path."""
    from kvwire.kernels import products

    from .test_devices import tiny_lm

    calls, real = [], gemv.product
    monkeypatch.setattr(gemv, "product", lambda x, w, b=None: calls.append((w.shape, w.dtype)) or real(x, w, b))
    lm = tiny_lm("gemma3").to(torch.bfloat16)
    lm.head.pack.after = 1  # would pack at once where the GEMV is not taken
    runs = {}
    for row in ("mkl", "kvwire"):
        monkeypatch.setattr(products, "f32_row", lambda r=row: r)
        calls.clear()
        lm.reset_caches()
        runs[row] = lm.generate(["Hello there"], max_new_tokens=6, ignore_eos=True, return_logprobs=True)
        assert bool(calls) == (row == "kvwire")
    assert set(calls) == {(lm.head.weight.shape, torch.bfloat16)} and len(calls) == 6
    assert lm.head.pack.packed is None
    torch.testing.assert_close(torch.tensor(runs["kvwire"].logprobs[0]), torch.tensor(runs["mkl"].logprobs[0]),
                               atol=0.05, rtol=0.02)


def test_the_bf16_heads_one_row_kind_follows_the_gemv_choice(monkeypatch):
    """Where the GEMV is chosen (`f32_row()` "kvwire"), a bfloat16 head's one-row product takes it;
    projections, other row counts, and other CPUs keep oneDNN's pack (or `linear`)."""
    from kvwire.kernels import products

    monkeypatch.setattr(products, "bf16_gemm", lambda: "packed")
    monkeypatch.setattr(products, "f32_row", lambda: "kvwire")
    kind = products.pack_kind
    assert kind("head", 1, torch.bfloat16, True) == "row"
    assert kind("projection", 1, torch.bfloat16, True) == "onednn"
    assert kind("head", 4, torch.bfloat16, True) == "onednn"
    monkeypatch.setattr(products, "f32_row", lambda: "mkl")
    assert kind("head", 1, torch.bfloat16, True) == "onednn"


def test_the_choice_follows_the_gemv_path_and_the_cpu(monkeypatch):
    real = cpu.features()
    monkeypatch.setattr(gemv, "available", lambda: True)
    for path, avx512, expected in (("linear", True, "kvwire"), ("linear", False, "mkl"),
                                   ("transposed", True, "mkl")):
        monkeypatch.setenv("KVWIRE_F32_GEMV", path)
        monkeypatch.setattr(cpu, "features", lambda a=avx512: {**real, "avx512": a})
        cpu.f32_gemv.cache_clear()
        cpu.f32_row.cache_clear()
        assert cpu.f32_row() == expected, (path, avx512)
    monkeypatch.setattr(gemv, "available", lambda: False)  # no compiler: MKL, not an error
    monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")
    cpu.f32_row.cache_clear()
    assert cpu.f32_row() == "mkl"


def test_a_forced_choice_the_cpu_or_build_cannot_take_is_refused_by_name(monkeypatch):
    real = cpu.features()
    monkeypatch.setenv("KVWIRE_F32_ROW", "fastest")
    cpu.f32_row.cache_clear()
    with pytest.raises(ValueError, match=r"KVWIRE_F32_ROW='fastest'; expected one of kvwire, mkl"):
        cpu.f32_row()
    monkeypatch.setenv("KVWIRE_F32_ROW", "kvwire")
    monkeypatch.setattr(cpu, "features", lambda: {**real, "avx512": False})
    cpu.f32_row.cache_clear()
    with pytest.raises(ValueError, match="needs AVX-512F, which this CPU lacks"):
        cpu.f32_row()
    monkeypatch.setattr(cpu, "features", lambda: {**real, "avx512": True})
    monkeypatch.setattr(gemv, "available", lambda: False)
    monkeypatch.setattr(gemv, "unavailable_reason", lambda: "building kvwire's C kernels needs gcc")
    cpu.f32_row.cache_clear()
    with pytest.raises(ValueError, match="could not be built here: building kvwire's C kernels needs gcc"):
        cpu.f32_row()
    monkeypatch.setenv("KVWIRE_F32_ROW", "mkl")  # always possible
    cpu.f32_row.cache_clear()
    assert cpu.f32_row() == "mkl"


def test_a_failed_build_is_reported_once_and_leaves_mkl(monkeypatch, tmp_path):
    """No compiler on PATH, a source that does not compile: `BuildError` with what was run and why;
    the kernel's loader remembers the failure (one try a process) and the choice falls back."""
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(build.BuildError, match="building kvwire's C kernels failed .*no-such-cc"):
        build.library("kvw_broken", [gemv.SOURCE], ["-O2"])
    monkeypatch.delenv("CC")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.BuildError, match=r"needs gcc \(or \$CC\); none on PATH"):
        build.library("kvw_none", [gemv.SOURCE], ["-O2"])
    monkeypatch.undo()
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("int f( {\n")
    with pytest.raises(build.BuildError, match=r"broken\.c"):
        build.library("kvw_broken", [broken], ["-O2"])
    assert not list(tmp_path.glob("native/*/libkvw_broken.so"))  # nothing half-built left as the library

    saved = dict(gemv._LIB)
    tries = []
    monkeypatch.setattr(gemv, "library", lambda *a: tries.append(a) or (_ for _ in ()).throw(build.BuildError("no cc")))
    gemv._LIB.clear()
    try:
        assert not gemv.available() and not gemv.available()
        assert len(tries) == 1 and gemv.unavailable_reason() == "no cc"
        monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")
        cpu.f32_gemv.cache_clear()
        cpu.f32_row.cache_clear()
        assert cpu.f32_row() == "mkl"
    finally:
        gemv._LIB.clear()
        gemv._LIB.update(saved)
