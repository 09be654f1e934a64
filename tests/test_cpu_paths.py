"""Kernel paths chosen by the CPU: bf16 GEMMs stay bf16 where the CPU has bf16 units, and are upcast
to float32 where it has not; few-row float32 products run `linear` on Intel CPUs and W @ x^T
elsewhere. Each branch is tested where it runs; the other is skipped."""
import pytest
import torch

from kvwire.kernels import cpu
from kvwire.kernels.products import linear
from kvwire.layers.linear import Linear


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    for name in ("KVWIRE_BF16_GEMM", "KVWIRE_F32_GEMV", "KVWIRE_F32_ROW"):
        monkeypatch.delenv(name, raising=False)
    clear = (cpu.bf16_gemm.cache_clear, cpu.f32_gemv.cache_clear, cpu.f32_row.cache_clear)
    for c in clear:
        c()
    yield
    for c in clear:
        c()


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


NO_BF16_UNITS = "this CPU has no bf16 units (AVX512_BF16/AMX): the native and packed paths do not run"


@pytest.mark.skipif(not cpu.native_bf16(), reason=NO_BF16_UNITS)
def test_bf16_gemm_stays_bf16_on_packed_weights_on_a_cpu_with_bf16_units(monkeypatch):
    assert cpu.bf16_gemm() == ("packed" if torch.backends.mkldnn.is_available() else "native")
    assert dtype_reaching_gemm(monkeypatch) == torch.bfloat16


@pytest.mark.skipif(not cpu.native_bf16(), reason=NO_BF16_UNITS)
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build: nothing is packed")
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_products_run_on_a_packed_copy_with_the_same_values(monkeypatch, bias):
    """`Linear` packs a bf16 weight for oneDNN after `after` products and gives linear's values bit
    for bit at every row count (a strided input as its dense copy: with a bias, linear on the strided
    view itself rounds the product and the sum separately); an in-place edit is followed; "native"
    never packs."""
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 80, bias=bias).to(torch.bfloat16)
    layer.pack.after = 2
    xs = [torch.randn(rows, 96, generator=g).to(torch.bfloat16) for rows in (1, 4, 33)]
    xs += [torch.randn(2, 5, 96, generator=g).to(torch.bfloat16)[:, ::2],  # strided views: made dense first
           torch.randn(96, 3, generator=g).to(torch.bfloat16).t(), torch.randn(96, generator=g).to(torch.bfloat16)]
    with torch.inference_mode():
        for rows_x in xs:
            for _ in range(3):
                torch.testing.assert_close(layer(rows_x), torch.nn.functional.linear(rows_x.contiguous(), layer.weight,
                                                                                     layer.bias), atol=0, rtol=0)
        assert layer.pack.packed is not None and layer.pack.packed.is_mkldnn
        layer.weight.mul_(-0.5)  # in place: the stale copy goes, the next products read the new values
        for _ in range(3):
            torch.testing.assert_close(layer(xs[0]), torch.nn.functional.linear(xs[0], layer.weight, layer.bias),
                                       atol=0, rtol=0)
        layer.pack.clear()
        monkeypatch.setenv("KVWIRE_BF16_GEMM", "native")
        cpu.bf16_gemm.cache_clear()
        for _ in range(3):
            layer(xs[1])
        assert layer.pack.packed is None
    with torch.enable_grad():  # autograd: the packed kernel has no backward, so `linear` runs
        monkeypatch.delenv("KVWIRE_BF16_GEMM")
        cpu.bf16_gemm.cache_clear()
        out = [layer(xs[0].requires_grad_()) for _ in range(3)][-1]
        assert layer.pack.packed is None and out.requires_grad


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
    for asked in ("native", "packed"):
        monkeypatch.setenv("KVWIRE_BF16_GEMM", asked)
        with pytest.raises(ValueError, match=f"KVWIRE_BF16_GEMM={asked} needs bfloat16 dot-product units, but "
                                             "this CPU has neither AVX512_BF16 nor AMX"):
            cpu.bf16_gemm()
        cpu.bf16_gemm.cache_clear()
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "packed")
    with pytest.raises(ValueError, match=r"KVWIRE_BF16_GEMM=packed needs oneDNN, which this torch build lacks"):
        cpu.bf16_gemm()
    cpu.bf16_gemm.cache_clear()
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match=r"KVWIRE_BF16_GEMM='fast'; expected one of packed, native, upcast"):
        cpu.bf16_gemm()


def test_the_report_names_features_and_paths():
    line = cpu.report()
    assert "avx512_bf16" in line and f"bf16 GEMM: {cpu.bf16_gemm()}" in line
    assert f"float32 GEMV: {cpu.f32_gemv()};" in line
    assert all(isinstance(v, bool) for v in cpu.features().values())


@pytest.mark.skipif(not cpu.native_bf16(), reason=NO_BF16_UNITS)
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build: nothing is packed")
@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_a_bf16_model_generates_the_same_tokens_on_packed_weights(monkeypatch, family):
    """Generation long enough to pack every bf16 projection and the head (64 products each) gives
    the tokens and log-probabilities the unpacked weights give; `reset_caches` frees the copies."""
    from kvwire.layers.linear import WeightPack

    from .test_devices import tiny_lm

    lm = tiny_lm(family, dtype="bfloat16")
    packs = [m.pack for m in lm.modules() if isinstance(getattr(m, "pack", None), WeightPack)]
    assert len(packs) > 4  # the head's and every projection's (gpt2: bias too)
    runs = {}
    for choice in ("native", "packed"):
        monkeypatch.setenv("KVWIRE_BF16_GEMM", choice)
        cpu.bf16_gemm.cache_clear()
        out = lm.generate(["Hello there", "A"], max_new_tokens=70, ignore_eos=True, return_logprobs=True)
        runs[choice] = (out.tokens, out.logprobs)
        assert all((p.packed is not None) == (choice == "packed") for p in packs), choice
        if choice == "native":
            lm.reset_caches()
    assert runs["packed"][0] == runs["native"][0]
    torch.testing.assert_close(runs["packed"][1], runs["native"][1], atol=0, rtol=0)
    lm.reset_caches()
    assert all(p.packed is None for p in packs)


@pytest.mark.skipif(not cpu.native_bf16(), reason=NO_BF16_UNITS)
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build: nothing is packed")
def test_bf16_products_read_the_pack_up_to_256_rows():
    """Decode and short prompts read the packed copy; a long prompt's chunk (from ~384 rows oneDNN's
    own call is faster) takes `linear`; the head's one row takes kvwire's GEMV where it is chosen."""
    from kvwire.kernels.products import PACKED_BF16_ROWS
    from kvwire.layers.linear import WeightPack

    assert cpu.bf16_gemm() == "packed" and PACKED_BF16_ROWS == 256
    w = torch.randn(96, 64).bfloat16()
    for role in ("head", "projection"):
        with torch.inference_mode():
            got = {rows: WeightPack(role=role).kind(torch.randn(1, rows, 64).bfloat16(), w, None)
                   for rows in (1, 4, 256, 257, 512)}
        one = "row" if role == "head" and cpu.f32_row() == "kvwire" else "onednn"
        assert got == {1: one, 4: "onednn", 256: "onednn", 257: None, 512: None}, role


@pytest.mark.skipif(cpu.f32_row() != "kvwire", reason="kvwire's GEMV is not chosen here (no AVX-512F, another "
                    "GEMV path, or no build): a bf16 head stays on oneDNN in compiled steps")
def test_a_compiled_bf16_batch1_step_sends_only_its_head_to_the_gemv():
    """Compiled bfloat16 batch-1 steps: the head's one row through `kvwire::packed_linear` (kvwire's
    GEMV at run time), every projection Inductor's own; the eager run's tokens and close log-probs."""
    from torch._inductor.utils import run_and_get_code

    from kvwire.kernels.native import gemv

    from .test_devices import tiny_lm

    torch._dynamo.reset()
    lm = tiny_lm("gemma3").to(torch.bfloat16)
    eager = lm.generate(["Hello there"], max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    lm.compile(ahead=False, bucket=32)
    calls, real = [], gemv.product
    try:
        gemv.product = lambda x, w, b=None: calls.append(w.shape) or real(x, w, b)
        out, code = run_and_get_code(lambda: lm.generate(["Hello there"], max_new_tokens=6, ignore_eos=True,
                                                         return_logprobs=True))
    finally:
        gemv.product = real
    assert "".join(code).count("torch.ops.kvwire.packed_linear.default(") == 2  # the step's and the prompt's heads
    assert set(calls) == {lm.head.weight.shape} and len(calls) >= 5
    # bf16 rounding differs between Inductor's fused ops and eager ones: a near tie later in a random
    # tiny model could pick another token, so the first steps are compared
    assert out.tokens[0][:3] == eager.tokens[0][:3]
    torch.testing.assert_close(torch.tensor(out.logprobs[0][:3]), torch.tensor(eager.logprobs[0][:3]), atol=0.05,
                               rtol=0.02)


def float32_path(monkeypatch, rows):
    """[(kind, rows)] of the products a float32 `linear` of `rows` rows ran: ("linear", rows) for
    nn.functional.linear, ("matmul", rows) for W @ x^T, ("kvwire", rows) for kvwire's GEMV; its values
    checked against x @ W^T."""
    from kvwire.kernels.native import gemv

    seen = []
    real_linear, real_matmul, real_gemv = torch.nn.functional.linear, torch.Tensor.__matmul__, gemv.product
    x, w = torch.randn(rows, 64), torch.randn(96, 64)  # a wide weight: "transposed" repeats odd rows
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "linear",
                  lambda x, w, b=None: seen.append(("linear", x.shape[0])) or real_linear(x, w, b))
        m.setattr(torch.Tensor, "__matmul__", lambda a, b: seen.append(("matmul", b.shape[1])) or real_matmul(a, b))
        m.setattr(gemv, "product", lambda x, w, b=None: seen.append(("kvwire", x.shape[0])) or real_gemv(x, w, b))
        out = linear(x, w)
    torch.testing.assert_close(out, x @ w.t(), atol=1e-5, rtol=1e-5)
    return seen


ON_INTEL_AVX512 = cpu.cpuinfo_field("vendor_id") == "GenuineIntel" and cpu.features()["avx512"]
INTEL = "an Intel CPU with AVX-512: few-row float32 products run linear here"


def test_the_float32_gemv_follows_the_cpu_vendor_and_features(monkeypatch):
    real = cpu.features()
    for vendor, avx512, expected in (("GenuineIntel", True, "linear"), ("GenuineIntel", False, "transposed"),
                                     ("AuthenticAMD", True, "transposed"), (None, True, "transposed")):
        monkeypatch.setattr(cpu, "cpuinfo_field", lambda key, cpuinfo=None, v=vendor: v)
        monkeypatch.setattr(cpu, "features", lambda a=avx512: {**real, "avx512": a})
        cpu.f32_gemv.cache_clear()
        assert cpu.f32_gemv() == expected, (vendor, avx512)


@pytest.mark.skipif(not ON_INTEL_AVX512, reason="not " + INTEL)
def test_few_float32_rows_run_linear_on_an_intel_cpu_and_one_row_kvwires_gemv(monkeypatch):
    """One row (batch-1 decode) on kvwire's GEMV where it builds (this machine has a C compiler
    unless it says why not), else `linear`; `KVWIRE_F32_ROW=mkl` keeps it on `linear`."""
    from kvwire.kernels.native import gemv

    assert cpu.f32_gemv() == "linear"
    assert cpu.f32_row() == ("kvwire" if gemv.available() else "mkl"), gemv.unavailable_reason()
    assert float32_path(monkeypatch, 1) == [(("kvwire" if gemv.available() else "linear"), 1)]
    assert float32_path(monkeypatch, 3) == [("linear", 3)]
    monkeypatch.setenv("KVWIRE_F32_ROW", "mkl")
    cpu.f32_row.cache_clear()
    assert float32_path(monkeypatch, 1) == [("linear", 1)]


@pytest.mark.skipif(ON_INTEL_AVX512, reason=INTEL)
def test_few_float32_rows_run_transposed_with_an_even_row_count_elsewhere(monkeypatch):
    assert cpu.f32_gemv() == "transposed"
    assert float32_path(monkeypatch, 1) == [("matmul", 2)]  # the row repeated for a wide weight
    assert float32_path(monkeypatch, 4) == [("matmul", 4)]


def test_the_float32_gemv_can_be_forced_and_a_bad_value_is_refused(monkeypatch):
    for asked, path in (("linear", [("linear", 3)]), ("transposed", [("matmul", 4)])):
        monkeypatch.setenv("KVWIRE_F32_GEMV", asked)
        cpu.f32_gemv.cache_clear()
        assert cpu.f32_gemv() == asked and float32_path(monkeypatch, 3) == path
    monkeypatch.setenv("KVWIRE_F32_GEMV", "fast")
    cpu.f32_gemv.cache_clear()
    with pytest.raises(ValueError, match=r"KVWIRE_F32_GEMV='fast'; expected one of linear, transposed"):
        cpu.f32_gemv()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="no MKL in this torch build: nothing is packed")
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_float32_packs_follow_the_gemv_choice(monkeypatch):
    """'transposed': MKL's pack for the head at one row only; 'linear': oneDNN's for the head and
    MKL's for projections at 2-64 rows (batched decode), none at one row or a prompt's many."""
    from kvwire.layers.linear import WeightPack

    monkeypatch.setenv("KVWIRE_F32_ROW", "mkl")  # one row on kvwire's GEMV: tests/test_native_gemv.py
    w = torch.randn(96, 64)
    expected = {("linear", "head"): {1: None, 2: "onednn", 4: "onednn", 64: "onednn", 65: None},
                ("linear", "projection"): {1: None, 2: "mkl", 4: "mkl", 64: "mkl", 65: None},
                ("transposed", "head"): {1: "mkl", 2: None, 4: None, 65: None},
                ("transposed", "projection"): {1: None, 2: None, 4: None, 65: None}}
    for (asked, role), kinds in expected.items():
        monkeypatch.setenv("KVWIRE_F32_GEMV", asked)
        cpu.f32_gemv.cache_clear()
        with torch.inference_mode():
            got = {rows: WeightPack(role=role).kind(torch.randn(rows, 1, 64), w, None) for rows in kinds}
            assert got == kinds, (asked, role)
            # a biased product: a projection's MKL pack adds the bias, the head has none
            biased = WeightPack(role=role).kind(torch.randn(4, 1, 64), w, torch.zeros(96))
            assert biased == ("mkl" if (asked, role) == ("linear", "projection") else None), (asked, role)
    with pytest.raises(ValueError, match=r"role='lm_head'; expected 'head' or 'projection'"):
        WeightPack(role="lm_head")


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.backends.mkl.is_available()),
                    reason="no oneDNN or no MKL in this torch build")
@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_batched_float32_decode_on_packed_weights_gives_the_unpacked_tokens(monkeypatch, family):
    """The 'linear' path (forced, so any CPU runs it): a batch of 3 generating long enough to pack
    the head and every projection (64 products each) gives the tokens and log-probs of the same
    run with packing off; `reset_caches` frees the copies."""
    from kvwire.layers.linear import WeightPack

    from .test_devices import tiny_lm

    monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")
    cpu.f32_gemv.cache_clear()
    lm = tiny_lm(family)
    packs = [m.pack for m in lm.modules() if isinstance(getattr(m, "pack", None), WeightPack)]
    assert len(packs) > 4  # the head's and every projection's (gpt2: with biases)
    runs = {}
    for after in (10**9, 64):
        for p in packs:
            p.after = after
        runs[after] = lm.generate(["Hello there", "A", "xyz"], max_new_tokens=70, ignore_eos=True,
                                  return_logprobs=True)
        assert all((p.packed is not None) == (after == 64) for p in packs), after
    assert runs[64].tokens == runs[10**9].tokens
    torch.testing.assert_close(runs[64].logprobs, runs[10**9].logprobs, atol=1e-4, rtol=1e-4)
    lm.reset_caches()
    assert all(p.packed is None for p in packs)


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.backends.mkl.is_available()),
                    reason="no oneDNN or no MKL in this torch build")
def test_compiled_decode_reads_the_packed_copies(monkeypatch):
    """The 'linear' path (forced, so any CPU runs it): compiled decode steps of batch 3 call
    `kvwire::packed_linear` (opaque to Inductor) for the head and the projections, batch 1's for the
    head alone where `cpu.f32_row()` is "kvwire" (its GEMV), else none; with every copy made
    (after=1) they give the eager unpacked run's tokens and log-probs. Two layers (one sliding, one
    global) and the prompts eager: one graph a batch size to compile."""
    from torch._inductor.utils import run_and_get_code

    from kvwire.layers.linear import WeightPack

    from .test_devices import tiny_lm

    monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")
    cpu.f32_gemv.cache_clear()
    torch._dynamo.reset()
    lm = tiny_lm("gemma3", num_hidden_layers=2)
    packs = [m.pack for m in lm.modules() if isinstance(getattr(m, "pack", None), WeightPack)]
    prompts = {1: ["Hello there"], 3: ["Hello there", "A", "xyz"]}

    def run(rows):
        return lm.generate(rows, max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    for p in packs:
        p.after = 10**9
    eager = {batch: run(rows) for batch, rows in prompts.items()}
    for p in packs:
        p.after = 1
    lm.compile(ahead=False, bucket=32, prefill_tokens=0)
    for batch, rows in prompts.items():
        out, code = run_and_get_code(lambda: run(rows))
        assert out.tokens == eager[batch].tokens, batch
        torch.testing.assert_close(out.logprobs, eager[batch].logprobs, atol=1e-4, rtol=1e-4)
        calls = "".join(code).count("torch.ops.kvwire.packed_linear.default(")
        # batch 3: the step's every product; batch 1: the step's head on kvwire's GEMV
        assert calls == ((1 if cpu.f32_row() == "kvwire" else 0) if batch == 1 else len(packs)), (batch, calls)
        head = lm.head.pack
        assert (head.packed is None) if batch == 1 else (head.packed is not None and head.key[0] == "onednn")
    assert all(p.packed is not None for p in packs)
    lm.reset_caches()
    assert all(p.packed is None for p in packs)


def flash_dtypes(monkeypatch, lm, prompt):
    """The dtypes the flash kernel received over a generation of `prompt` (queries, keys, and the
    mask, or the values where it runs its own causal mask), and its log-probs."""
    from kvwire.layers import attention

    seen, real = [], attention._flash
    with monkeypatch.context() as m:
        m.setattr(attention, "_flash", lambda q, k, v, **kw: seen.append(
            (q.dtype, k.dtype, kw["attn_mask"].dtype if kw.get("attn_mask") is not None else v.dtype))
            or real(q, k, v, **kw))
        out = lm.generate(prompt, max_new_tokens=3, ignore_eos=True, return_logprobs=True)
    return set(seen), out


def test_a_prompt_attends_in_float32_when_bf16_is_upcast_or_the_model_is_float32(monkeypatch):
    """Any CPU: with many-row bf16 products upcast (the default without bf16 units) a bf16 model's
    prompt runs the flash kernel in float32, as does a float32 model's."""
    from .test_devices import tiny_lm

    monkeypatch.setenv("KVWIRE_BF16_GEMM", "upcast")
    lm = tiny_lm("gemma3", dtype="bfloat16")
    prompt = torch.randint(3, lm.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    assert flash_dtypes(monkeypatch, lm, prompt)[0] == {(torch.float32,) * 3}
    monkeypatch.delenv("KVWIRE_BF16_GEMM")
    cpu.bf16_gemm.cache_clear()
    assert flash_dtypes(monkeypatch, lm.to(torch.float32), prompt)[0] == {(torch.float32,) * 3}


@pytest.mark.skipif(not cpu.native_bf16(), reason=NO_BF16_UNITS)
def test_a_bf16_prompt_attends_in_bf16_on_a_cpu_with_bf16_units(monkeypatch):
    """A bf16 model's prompt runs the flash kernel in bf16 where the CPU has bf16 units; the
    log-probs stay within bf16 rounding of the float32 kernel's (upcast)."""
    from .test_devices import tiny_lm

    lm = tiny_lm("gemma3", dtype="bfloat16")
    prompt = torch.randint(3, lm.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    native, fast = flash_dtypes(monkeypatch, lm, prompt)
    assert native == {(torch.bfloat16,) * 3}
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "upcast")
    cpu.bf16_gemm.cache_clear()
    upcast, slow = flash_dtypes(monkeypatch, lm, prompt)
    assert upcast == {(torch.float32,) * 3}
    # bf16 rounding of q, k, v: measured 0.004
    torch.testing.assert_close(torch.tensor(fast.logprobs), torch.tensor(slow.logprobs), atol=0.02, rtol=0)


class _Product(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(96, 64, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return linear(x, self.weight)


def _exported_ops(x, own_step):
    """The call targets of `_Product` exported at x's shape, as kvwire's own step (`compiled_steps`)
    or as any other export."""
    from contextlib import nullcontext

    from kvwire.kernels.products import compiled_steps

    with torch.no_grad(), (compiled_steps() if own_step else nullcontext()):
        program = torch.export.export(_Product(), (x,), strict=False)
    product = program.module()(x)
    torch.testing.assert_close(product, x @ _Product().weight.detach().t(), atol=1e-5, rtol=1e-5)
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_a_compiled_step_keeps_the_product_form_this_cpu_streams_faster(monkeypatch):
    """Exported as kvwire's own compiled step, few float32 rows keep W @ x^T where that is the
    CPU's form (MKL then runs the few rows as its small dimension); other exports keep `linear`,
    and so does the `linear` form. Both forms forced, whatever this CPU chooses."""
    x = torch.randn(4, 64)
    for asked, own in (("transposed", True), ("linear", False)):
        monkeypatch.setenv("KVWIRE_F32_GEMV", asked)
        cpu.f32_gemv.cache_clear()
        step, other = _exported_ops(x, own_step=True), _exported_ops(x, own_step=False)
        assert ("aten.linear.default" not in step) is own, (asked, step)
        assert "aten.linear.default" in other, (asked, other)
    monkeypatch.setenv("KVWIRE_F32_GEMV", "transposed")
    cpu.f32_gemv.cache_clear()
    assert "aten.linear.default" in _exported_ops(torch.randn(65, 64), own_step=True)  # many rows: linear
