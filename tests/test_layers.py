"""Layer-level checks that the model-level runners would only show indirectly."""
import pytest
import torch

from kvwire.kernels import cpu
from kvwire.kernels.products import SMALL_ROWS, linear


@pytest.fixture(autouse=True)
def fresh_gemv():
    """The float32 GEMV choice reads KVWIRE_F32_GEMV once: tests that set it clear it first, and
    it is cleared after every test here."""
    yield
    cpu.f32_gemv.cache_clear()
    cpu.f32_row.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 4, SMALL_ROWS, SMALL_ROWS + 1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [40, 48, 64], ids=["narrow", "square", "wide"])
@pytest.mark.parametrize("gemv", cpu.F32_CHOICES)
def test_linear_kernel_choice_matches_nn_functional(rows, dtype, bias, out, gemv, monkeypatch):
    """Every path gives linear's values on any CPU (the float32 GEMV choice is speed only): at 1 and
    3 float32 rows "transposed" reads a repeated row whose result is dropped for a square or wide
    weight, not for a narrow one; 65 rows and up, and "linear" always, run `linear`."""
    monkeypatch.setenv("KVWIRE_F32_GEMV", gemv)
    cpu.f32_gemv.cache_clear()  # and after the test (`fresh_gemv`)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 48, generator=g).to(dtype)
    w = torch.randn(out, 48, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got = linear(x, w, b)
    assert got.shape == (rows, 1, out) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_one_row_pack_matches_linear_and_follows_weight_edits(monkeypatch):
    import copy

    from kvwire.layers.linear import WeightPack

    if not torch.backends.mkl.is_available():
        pytest.skip("no MKL in this torch build")
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "upcast")  # bf16 products are never packed then
    monkeypatch.setenv("KVWIRE_F32_GEMV", "transposed")  # the float32 pack's path (any CPU can run it)
    cpu.bf16_gemm.cache_clear()
    cpu.f32_gemv.cache_clear()  # and after the test (`fresh_gemv`)
    pack = WeightPack(after=3)
    w = torch.randn(300, 48)
    x = torch.randn(1, 1, 48)
    with torch.inference_mode():
        assert pack(x, w) is None and pack(x, w) is None and pack.packed is None  # not packed for short runs
        got = pack(x, w)
        assert got.shape == (1, 1, 300)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w))
        assert pack.packed is not None
        w.mul_(2.0)  # an in-place edit: the packed copy must follow (packed again after 3 calls)
        assert pack(x, w) is None and pack(x, w) is None
        torch.testing.assert_close(pack(x, w), torch.nn.functional.linear(x, w))
        assert pack(torch.randn(2, 48), w) is None  # several rows: `linear` does them
        assert pack(x.bfloat16(), w.bfloat16()) is None
    with torch.enable_grad():  # another test may leave grad mode off in this process
        assert pack(x, w.requires_grad_()) is None  # autograd: the packed kernel has no backward
    assert copy.deepcopy(pack).packed is None
    cpu.bf16_gemm.cache_clear()


def test_few_row_float32_pack_matches_linear(monkeypatch):
    """The 'linear' path's head pack (oneDNN, 2-64 rows) equals `linear` to float32 rounding, for
    3-D and strided inputs, and follows an in-place edit of the weight."""
    from kvwire.layers.linear import WeightPack

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")
    cpu.f32_gemv.cache_clear()  # and after the test (`fresh_gemv`)
    pack = WeightPack(after=2)
    w = torch.randn(300, 48)
    x = torch.randn(4, 1, 48)
    with torch.inference_mode():
        assert pack(x, w) is None and pack.packed is None
        torch.testing.assert_close(pack(x, w), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
        strided = torch.randn(4, 96)[:, ::2].unsqueeze(1)  # (4, 1, 48), not contiguous
        torch.testing.assert_close(pack(strided, w), torch.nn.functional.linear(strided, w), atol=1e-5, rtol=1e-5)
        w.mul_(-1.0)
        assert pack(x, w) is None
        torch.testing.assert_close(pack(x, w), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
        # one row: kvwire's GEMV on the weight itself where it runs, else None (`linear` reads as fast)
        one = pack(x[:1], w)
        assert (one is None) == (cpu.f32_row() != "kvwire")
        if one is not None:
            torch.testing.assert_close(one, torch.nn.functional.linear(x[:1], w), atol=1e-5, rtol=1e-5)


def test_few_row_float32_projection_pack_adds_the_bias_and_follows_the_row_count(monkeypatch):
    """The 'linear' path's projection pack (MKL, made for one row count) equals `linear` with a
    bias; another row count takes `linear` (the pack kept: a prompt chunk between decode steps)
    until `after` products of one new count come in a row, then it is packed for that count."""
    from kvwire.layers.linear import WeightPack

    if not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()):
        pytest.skip("no MKL or no oneDNN in this torch build (MKL's packed ops need both)")
    monkeypatch.setenv("KVWIRE_F32_GEMV", "linear")
    cpu.f32_gemv.cache_clear()  # and after the test (`fresh_gemv`)
    pack = WeightPack(after=2, role="projection")
    w, b = torch.randn(300, 48), torch.randn(300)
    x4, x3 = torch.randn(4, 1, 48), torch.randn(3, 1, 48)
    close = lambda got, x: torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5,  # noqa: E731
                                                      rtol=1e-5)
    with torch.inference_mode():
        assert pack(x4, w, b) is None
        close(pack(x4, w, b), x4)
        assert pack.rows == 4
        for _ in range(3):  # 3 rows between 4-row products: `linear`, and the 4-row pack stays
            assert pack(x3, w, b) is None
            close(pack(x4, w, b), x4)
        x2 = torch.randn(2, 1, 48)
        for x in (x3, x2, x3, x2):  # other counts, but never one twice in a row: the 4-row pack stays
            assert pack(x, w, b) is None
        assert pack.rows == 4 and pack(x3, w, b) is None
        close(pack(x3, w, b), x3)  # the second 3-row product in a row: packed for 3
        assert pack.rows == 3
    with torch.enable_grad():  # autograd: the packed kernel has no backward
        assert pack(x3, w.requires_grad_(), b) is None


@pytest.mark.parametrize("cache_seen", ["none", "some rows", "every row", "a written prefix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_matches_dense_whatever_each_block_shows(monkeypatch, cache_seen, dtype):
    """The fused kernel runs per block and skips a block no row sees, or the masking after it when
    every row sees a key; merged, it equals dense attention over both blocks at once (GQA 4/1). For
    a bf16 layer on a CPU with bf16 units the kernel runs in bf16 (the merge float32; a single
    block's output stays bf16 for the output projection): within bf16 rounding of the dense float32 path.
    Cache slots past the last one any row sees (a cache longer than what is written) are not read."""
    from kvwire.layers import attention
    from kvwire.layers.shared import per_call

    torch.manual_seed(0)
    attn = attention.Attention(32, 4, 1, 8)
    T, S = 80, 24  # 4 * 80 query rows: the flash path
    q = torch.randn(2, 4, T, 8)
    cache_k, cache_v, chunk_k, chunk_v = (torch.randn(2, 1, n, 8) for n in (S, S, T, T))
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(2, T, T)
    old = torch.rand(2, T, S) < 0.5
    if cache_seen == "none":
        old[:] = False
    elif cache_seen == "some rows":
        old[:, ::3] = False
    elif cache_seen == "a written prefix":
        old[:, :, 10:] = False
        old[:, :, 9] = True
    else:
        old[:, :, 0] = True
    blocks = [(cache_k, cache_v, old), (chunk_k, chunk_v, causal)]
    calls, keys = [], []
    flash = attention._flash
    monkeypatch.setattr(attention, "_flash", lambda *a, **k: calls.append(a[0].dtype) or keys.append(a[1].shape[2])
                        or flash(*a, **k))
    with per_call():
        fused = attn._attend(q, blocks, dtype)
    kernel = torch.bfloat16 if dtype == torch.bfloat16 and cpu.bf16_gemm() != "upcast" else torch.float32
    assert calls == [kernel] * (1 if cache_seen == "none" else 2)  # the fused kernel ran, once a block seen
    assert keys[0] == {"none": T, "a written prefix": 10}.get(cache_seen, S)
    assert fused.dtype == (kernel if cache_seen == "none" else torch.float32)
    monkeypatch.setattr(attention, "FLASH_ROWS", 10 ** 9)
    dense = attn._attend(q, blocks)
    fused = fused.float()
    tol = 1e-5 if kernel == torch.float32 else 2e-2  # bf16 rounding of q, k, v and the probabilities
    torch.testing.assert_close(fused, dense, atol=tol, rtol=tol)
    bias, seen, used = attention._flash_bias(old, 4)
    assert (bias is None) == (cache_seen == "none") and (seen is None) == (cache_seen != "some rows")
    assert used == {"none": 0, "a written prefix": 10}.get(cache_seen, S)


def test_dense_attention_reads_a_cache_block_up_to_its_last_seen_slot(monkeypatch):
    """A decode step's dense attention (one query row a head) leaves out the slots past the last
    one any row sees (the engine's timeline is longer than its rows' sequences), a block no row
    sees at all, and equals attention over every slot."""
    from kvwire.layers import attention
    from kvwire.layers.shared import per_call

    torch.manual_seed(1)
    attn = attention.Attention(32, 4, 1, 8)
    q = torch.randn(2, 4, 1, 8)
    cache_k, cache_v, chunk_k, chunk_v = (torch.randn(2, 1, n, 8) for n in (24, 24, 1, 1))
    old = torch.zeros(2, 1, 24, dtype=torch.bool)
    old[0, 0, :10], old[1, 0, :6] = True, True  # row 0 has written 10 slots, row 1 six
    unseen = torch.zeros(2, 1, 5, dtype=torch.bool)
    blocks = [(cache_k, cache_v, old), (torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), unseen),
              (chunk_k, chunk_v, torch.ones(2, 1, 1, dtype=torch.bool))]
    widths, matmul = [], torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: widths.append(b.shape[-1]) or matmul(a, b))
    with per_call():
        got = attn._attend(q, blocks)
    monkeypatch.setattr(torch, "matmul", matmul)
    assert widths[:2] == [10, 1]  # the scores' key columns: 10 of 24 cached slots, no unseen block, the chunk
    dense = attn._attend(q, [(cache_k[:, :, :10], cache_v[:, :, :10], old[..., :10]), blocks[2]])
    torch.testing.assert_close(got, dense)
    with torch.no_grad():  # the reference over every slot, written out
        scores = torch.cat([q.reshape(2, 1, 4, 8) @ k.transpose(-1, -2) for k in (cache_k, chunk_k)], -1) * attn.scale
        seen = torch.cat([old, torch.ones(2, 1, 1, dtype=torch.bool)], -1)[:, None]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        want = probs[..., :24] @ cache_v + probs[..., 24:] @ chunk_v
    torch.testing.assert_close(got, want.view(2, 4, 1, 8), atol=1e-5, rtol=1e-5)


def test_layers_run_on_a_torch_without_is_exporting(monkeypatch):
    """torch 2.6 (inside pyproject's range) has no `torch.compiler.is_exporting`: linear's one-row
    pack, which asks on every eager call, reads it as False there (attention asks only while
    compiling, which this torch's own compile needs the attribute for)."""
    import kvwire as kw
    from kvwire.kernels.tracing import is_exporting

    from .conftest import FAMILIES

    lm = kw.from_hf(FAMILIES["llama"]())
    prompt = torch.tensor([[3, 17, 42, 9]])
    expected = lm.generate(prompt, max_new_tokens=4, ignore_eos=True, return_logprobs=True).tokens
    monkeypatch.delattr(torch.compiler, "is_exporting")
    assert is_exporting() is False
    assert lm.generate(prompt, max_new_tokens=4, ignore_eos=True, return_logprobs=True).tokens == expected
