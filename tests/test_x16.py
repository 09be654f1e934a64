"""Q4_1, Q5_0, Q8_0 and Q4_K blocks repacked for kvwire's kernel (`x16.c`: AVX-512 VNNI for all four, AVX2
for Q4_1, Q8_0 and Q4_K; Q6_K on AVX2 alone): the repacking is lossless, the kernel computes ggml's products (to float32 summation order)
at every row count and shape, and the choice between it and ggml's own kernels follows the CPU,
refusing what it cannot run. Each test runs the branch this CPU takes and skips the formats it
leaves to ggml's kernels."""
import copy
import importlib.util

import pytest
import torch

HAVE_GGML = importlib.util.find_spec("llama_cpp") is not None
pytestmark = pytest.mark.skipif(not HAVE_GGML, reason="ggml kernels need llama-cpp-python (kvwire[ggml])")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVWIRE_GGML_KERNEL", raising=False)


def _x16_runs():
    from kvwire.kernels.ggml.lib import x16_runs

    return x16_runs()


needs_x16 = pytest.mark.skipif("not HAVE_GGML or not _x16_runs()",
                               reason="this CPU lacks AVX-512 F/BW/VL + VNNI and AVX2: the x16 kernel does not run here")
FORMATS = ["q4_1", "q5_0", "q8_0", "q4_k", "q6_k"]


def _skip_unless_x16_runs(kind):
    """Skip where this CPU leaves `kind` to ggml's kernels (AVX2 runs x16 for Q4_1, Q8_0, Q4_K and Q6_K only)."""
    from kvwire.kernels.ggml.lib import x16_runs
    from kvwire.quant.ggml.linear import qtype_of

    if not x16_runs(int(qtype_of(kind))):
        pytest.skip(f"this CPU runs x16 for Q4_1, Q8_0, Q4_K and Q6_K only (AVX2, no AVX-512 VNNI): {kind} stays on ggml's "
                    "kernels")


@pytest.fixture(params=["native", "as_avx2"])
def branch(request):
    """The test on the kernels this CPU takes, then, where those are AVX-512 VNNI's, again as on a CPU
    with AVX2 alone (`lib.as_avx2`): machines of either kind test the AVX2 branch."""
    if request.param == "native":
        yield
        return
    from kvwire.kernels.ggml import lib
    from kvwire.quant.ggml.linear import qtype_of

    if not lib.x16_runs(int(qtype_of("q5_0"))):  # Q5_0 runs x16 with AVX-512 VNNI alone
        pytest.skip("this CPU has no AVX-512 VNNI: its native run is the AVX2 branch (or no x16 at all)")
    with lib.as_avx2():
        assert [lib.x16_runs(int(qtype_of(kind))) for kind in FORMATS] == [True, False, True, True, True]
        yield


def _n(kind, n):
    """A row length `kind` can hold: K-quants' super-blocks take 256 weights, the others' blocks 32."""
    return -(-n // 256) * 256 if kind.endswith("_k") else n


def _pair(out, n, seed=0, kind="q4_1"):
    """The same weight in `kind` blocks on ggml's kernels and on x16."""
    from kvwire.quant.ggml import GGMLLinear

    n = _n(kind, n)
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed))
    return GGMLLinear.quantize(w, kind, kernel="ggml"), GGMLLinear.quantize(w, kind, kernel="x16")


@needs_x16
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("out, n", [(48, 256), (37, 576), (16, 32), (1, 1536), (200, 1536)])
def test_repacked_blocks_hold_ggmls_bytes_and_values(out, n, kind):
    from kvwire.quant.ggml.linear import X16

    _skip_unless_x16_runs(kind)
    plain, packed = _pair(out, n, kind=kind)
    n = _n(kind, n)
    assert plain.kernel_type == int(plain.qtype) and packed.kernel_type == X16[packed.qtype]
    assert packed.repacked and not plain.repacked and "repacked for x16" in repr(packed)
    assert packed.blocks.shape == plain.blocks.shape
    # the layout did change (but for one row of one block, or of Q6_K, whose fields are all 4-byte lanes)
    assert not torch.equal(packed.blocks, plain.blocks) or out == 1 and (n in (32, 256) or kind == "q6_k")
    assert torch.equal(packed.ggml_blocks(), plain.blocks)  # and back, byte for byte
    assert torch.equal(packed.dequantize(), plain.dequantize())


@needs_x16
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("out, n", [(48, 256), (37, 576), (45, 256), (200, 1536)])  # last groups of 16, 5, 13, 8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32, 45])
def test_x16_computes_ggmls_products(out, n, rows, kind, branch):
    """Each block's integer dot product and scaling are ggml's: only the float sums' order differs.
    (Past 32 rows ggml's layout dequantises for float32 GEMM; x16 keeps its kernel: the operator.)"""
    _skip_unless_x16_runs(kind)
    plain, packed = _pair(out, n, seed=rows, kind=kind)
    n = _n(kind, n)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(100 + rows))
    expected = torch.ops.kvwire.ggml_matmul(x, plain.blocks, plain.kernel_type, n)
    got = packed(x)
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    assert torch.equal(got, torch.ops.kvwire.ggml_matmul(x, packed.blocks, packed.kernel_type, n))  # x16's op ran
    reference = x @ plain.dequantize().t()  # and both are the float product up to 8-bit activations
    torch.testing.assert_close(got, reference, atol=0.02 * reference.abs().max().item(), rtol=0)


@needs_x16
def test_q8_0_weights_of_minus_128_compute_as_ggmls(branch):
    """A file may hold Q8_0 bytes of -128 (ggml's quantiser writes -127..127): the kernel's byte
    products take them exactly (AVX2's sign trick: |-128| read unsigned is 128, and its pair sums
    stay within int16), as ggml's own kernel does."""
    import numpy as np

    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import qtype_of

    g = np.random.default_rng(7)
    out, n = 27, 128  # a last group of 11 rows
    blocks = np.zeros((out, n // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    quants = g.integers(-128, 128, size=(out, n // 32, 32)).astype(np.int8)
    quants[:, :, ::3] = -128
    blocks[:, :, 2:] = quants.view(np.uint8)
    blocks = torch.from_numpy(blocks.reshape(out, -1))
    q8_0 = qtype_of("q8_0")
    plain, packed = GGMLLinear(blocks, q8_0, n, kernel="ggml"), GGMLLinear(blocks, q8_0, n, kernel="x16")
    assert packed.repacked and torch.equal(packed.ggml_blocks(), plain.blocks)
    for rows in (1, 3, 6):
        x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 10
        expected = torch.ops.kvwire.ggml_matmul(x, plain.blocks, plain.kernel_type, n)
        torch.testing.assert_close(packed(x), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@needs_x16
def test_q4_k_at_its_largest_computes_as_ggmls(branch):
    """Q4_K blocks whose nibbles are all 15 and 6-bit scales and minimums all 63, against activations
    that quantise to -127 (a super-block's first sub-block) and +127 (the other seven; ggml's Q8_K
    scale is -127 / the first largest value): AVX2's 16-bit sums of a sub-block reach +-8 x 2 x 15 x 127
    = 30480 of int16's 32767, and must neither wrap nor saturate."""
    import numpy as np

    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import qtype_of

    _skip_unless_x16_runs("q4_k")
    out, n = 21, 512  # a last group of 5 rows
    blocks = np.full((out, n // 256, 144), 0xFF, dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # d
    blocks[:, :, 2:4] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)  # dmin
    blocks = torch.from_numpy(blocks.reshape(out, -1))
    q4_k = qtype_of("q4_k")
    plain, packed = GGMLLinear(blocks, q4_k, n, kernel="ggml"), GGMLLinear(blocks, q4_k, n, kernel="x16")
    assert packed.repacked
    for sign in (1.0, -1.0):  # the same integers, the float scale's sign flipped
        for rows in (1, 2, 5):
            x = torch.full((rows, n), sign * 3.0)
            x.view(rows, -1, 256)[:, :, :32] *= -1
            expected = torch.ops.kvwire.ggml_matmul(x, plain.blocks, plain.kernel_type, n)
            torch.testing.assert_close(packed(x), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
            reference = x @ plain.dequantize().t()
            torch.testing.assert_close(packed(x), reference, rtol=1e-3, atol=0)


@needs_x16
def test_q4_1_at_its_largest_computes_as_ggmls(branch):
    """Q4_1 blocks whose nibbles are all 15, against activations that quantise to +127 or -127 in every
    place: AVX2's 16-bit sums of a block reach +-8 x 2 x 15 x 127 = 30480 of int16's 32767, and must
    neither wrap nor saturate; each group's minimums come from the right lanes (a last group of 9 rows
    crosses into the second half)."""
    import numpy as np

    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import qtype_of

    _skip_unless_x16_runs("q4_1")
    out, n = 25, 256
    blocks = np.full((out, n // 32, 20), 0xFF, dtype=np.uint8)
    d = np.float16(0.01) * (1 + np.arange(out, dtype=np.float16)[:, None] / 8)  # a scale and minimum per row
    blocks[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(out, 1, 2)
    blocks[:, :, 2:4] = (-d).astype(np.float16).view(np.uint8).reshape(out, 1, 2)
    blocks = torch.from_numpy(blocks.reshape(out, -1))
    q4_1 = qtype_of("q4_1")
    plain, packed = GGMLLinear(blocks, q4_1, n, kernel="ggml"), GGMLLinear(blocks, q4_1, n, kernel="x16")
    assert packed.repacked
    for sign in (1.0, -1.0):
        for rows in (1, 2, 5):
            x = torch.full((rows, n), sign * 3.0)
            expected = torch.ops.kvwire.ggml_matmul(x, plain.blocks, plain.kernel_type, n)
            torch.testing.assert_close(packed(x), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
            reference = x @ plain.dequantize().t()
            torch.testing.assert_close(packed(x), reference, rtol=1e-3, atol=0)


@needs_x16
def test_q6_k_at_its_largest_computes_as_ggmls(branch):
    """Q6_K blocks whose 6-bit values are all 63 (ggml's 31 + 32) and 8-bit scales -128 and 127, against
    activations that quantise to -127 and +127: AVX2's 16-bit sums of two chunks reach
    +-2 x 2 x 63 x 127 = 32004 of int16's 32767, and the + 32 comes off exactly."""
    import numpy as np

    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import qtype_of

    _skip_unless_x16_runs("q6_k")
    out, n = 19, 512  # a last group of 3 rows
    blocks = np.full((out, n // 256, 210), 0xFF, dtype=np.uint8)  # ql, qh: all bits set
    scales = np.where(np.arange(16) % 3 == 0, -128, 127).astype(np.int8)
    blocks[:, :, 192:208] = scales.view(np.uint8)
    blocks[:, :, 208:] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)  # d
    blocks = torch.from_numpy(blocks.reshape(out, -1))
    q6_k = qtype_of("q6_k")
    plain, packed = GGMLLinear(blocks, q6_k, n, kernel="ggml"), GGMLLinear(blocks, q6_k, n, kernel="x16")
    assert packed.repacked
    for rows in (1, 2, 5):
        x = torch.full((rows, n), 3.0)
        x.view(rows, -1, 256)[:, :, :16] *= -1  # each super-block's first group -127, the others +127
        expected = torch.ops.kvwire.ggml_matmul(x, plain.blocks, plain.kernel_type, n)
        torch.testing.assert_close(packed(x), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
        reference = x @ plain.dequantize().t()
        torch.testing.assert_close(packed(x), reference, rtol=1e-3, atol=0)


@needs_x16
def test_a_fused_call_mixes_x16_with_other_formats():
    from kvwire.quant.ggml import GGMLLinear

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 768, generator=g)
    qs = [GGMLLinear.quantize(torch.randn(out, 768, generator=g), kind, kernel=kernel)
          for out, kind, kernel in [(40, "q4_1", "x16"), (24, "q8_0", None), (19, "q4_1", "ggml"), (33, "q5_0", "x16"),
                                    (17, "q5_0", "ggml"), (50, "q6_k", "x16"), (21, "q4_k", "x16"), (18, "q4_k", "ggml")]]
    fused = torch.ops.kvwire.ggml_matmuls(x, [q.blocks for q in qs], [q.kernel_type for q in qs], 768)
    for q, y in zip(qs, fused):
        assert torch.equal(y, torch.ops.kvwire.ggml_matmul(x, q.blocks, q.kernel_type, 768))


@needs_x16
@pytest.mark.parametrize("kind", FORMATS)
def test_requantize_and_copies_of_a_repacked_weight(kind):
    from kvwire.quant.ggml import GGMLLinear

    _skip_unless_x16_runs(kind)
    n = _n(kind, 64)
    plain, packed = _pair(16384 + 21, n, kind=kind)  # more than one of requantize's 4,096-row chunks
    assert torch.equal(packed.requantize("q8_0").blocks, plain.requantize("q8_0").blocks)
    x = torch.randn(2, n)
    clone = copy.deepcopy(packed)
    assert clone.kernel_type == packed.kernel_type and torch.equal(clone(x), packed(x))
    assert torch.equal(GGMLLinear(packed.ggml_blocks(), packed.qtype, n).blocks, packed.blocks)


@needs_x16
def test_state_dicts_hold_ggmls_layout_and_load_into_either_kernel():
    plain, packed = _pair(40, 96, kind="q8_0")  # 3 blocks: an odd count (Q8_0: x16 on every branch)
    assert torch.equal(packed.state_dict()["blocks"], plain.blocks)
    other_plain, other_packed = _pair(40, 96, seed=9, kind="q8_0")
    other_plain.load_state_dict(packed.state_dict())
    other_packed.load_state_dict(plain.state_dict())
    x = torch.randn(3, 96)
    assert torch.equal(other_plain(x), plain(x)) and torch.equal(other_packed(x), packed(x))
    assert other_packed.repacked and torch.equal(other_packed.blocks, packed.blocks)


def test_a_module_pickled_before_x16_existed_unpickles():
    from kvwire.quant.ggml import GGMLLinear

    q = GGMLLinear.quantize(torch.randn(16, 64), "q4_1", kernel="ggml")
    del q.kernel_type  # as pickles made before this attribute was added
    clone = copy.deepcopy(q)
    assert not clone.repacked and torch.equal(clone.blocks, q.blocks)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_copy_made_where_x16_ran_falls_back_where_it_does_not(monkeypatch, kind):
    """A repacked module unpickled on a CPU without the x16 kernel gets ggml's layout back."""
    from kvwire.kernels.ggml import lib
    from kvwire.quant.ggml import GGMLLinear

    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(6))
    if not lib.x16_runs():
        pytest.skip("this CPU lacks AVX-512 F/BW/VL + VNNI and AVX2: no repacked module can be made here")
    _skip_unless_x16_runs(kind)
    packed, plain = GGMLLinear.quantize(w, kind, kernel="x16"), GGMLLinear.quantize(w, kind, kernel="ggml")
    assert packed.repacked
    monkeypatch.setattr(lib, "x16_runs", lambda qtype=None: False)
    clone = copy.deepcopy(packed)
    assert not clone.repacked and torch.equal(clone.blocks, plain.blocks)
    x = torch.randn(2, 256)
    assert torch.equal(clone(x), plain(x))


def test_the_kernel_follows_the_cpu_and_refuses_what_it_cannot_run(monkeypatch):
    from kvwire.kernels import cpu
    from kvwire.kernels.ggml import lib
    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import qtype_of

    runs = lib.x16_runs()
    assert cpu.ggml_kernel() == ("x16" if runs else "ggml")
    w = torch.randn(32, 256)
    for kind in FORMATS:
        assert GGMLLinear.quantize(w, kind).repacked == lib.x16_runs(int(qtype_of(kind)))
    assert lib.x16_runs(int(qtype_of("q8_0"))) == runs  # Q8_0 runs x16 on every branch that runs it at all
    assert not GGMLLinear.quantize(w, "q4_0", kernel="x16").repacked  # only the formats x16 has
    monkeypatch.setenv("KVWIRE_GGML_KERNEL", "ggml")
    assert not GGMLLinear.quantize(w, "q4_1").repacked
    monkeypatch.setenv("KVWIRE_GGML_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVWIRE_GGML_KERNEL='fast'; expected one of x16, ggml"):
        GGMLLinear.quantize(w, "q5_0")
    monkeypatch.delenv("KVWIRE_GGML_KERNEL")
    with pytest.raises(ValueError, match="kernel='avx'; expected one of x16, ggml"):
        GGMLLinear.quantize(w, "q4_1", kernel="avx")
    monkeypatch.setattr(lib, "x16_runs", lambda qtype=None: False)  # a CPU without the features (no AVX2)
    assert cpu.ggml_kernel() == "ggml"
    with pytest.raises(ValueError, match="kernel=x16 needs AVX-512 F, BW and VL with AVX512_VNNI, or AVX2 with "
                                         "FMA and F16C, which this CPU"):
        GGMLLinear.quantize(w, "q4_1", kernel="x16")
    monkeypatch.setenv("KVWIRE_GGML_KERNEL", "x16")
    with pytest.raises(ValueError, match="KVWIRE_GGML_KERNEL=x16 needs AVX-512"):
        GGMLLinear.quantize(w, "q4_1")


def test_as_avx2_runs_q4_1_q8_0_q4_k_and_q6_k_alone_then_gives_the_cpus_choice_back():
    from kvwire.kernels.ggml import lib
    from kvwire.quant.ggml.linear import qtype_of

    def runs():
        return {kind: lib.x16_runs(int(qtype_of(kind))) for kind in FORMATS}

    before = runs()
    with lib.as_avx2():
        inside = runs()
        assert lib.library().kvw_x16_as_avx2(-1) == 1
    assert inside == {kind: kind in ("q4_1", "q8_0", "q4_k", "q6_k") and before["q8_0"] for kind in FORMATS}
    assert runs() == before and lib.library().kvw_x16_as_avx2(-1) == 0


def test_the_operator_refuses_repacked_blocks_where_x16_cannot_run(branch):
    from kvwire.kernels.ggml.lib import x16_runs
    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import X16

    refused = [number for qtype, number in X16.items() if not x16_runs(int(qtype))]
    if not refused:
        pytest.skip("this CPU runs the x16 kernel for every format: the refusal is other CPUs' branch")
    q = GGMLLinear.quantize(torch.randn(16, 64), "q4_1", kernel="ggml")
    for number in refused:
        with pytest.raises(RuntimeError, match=f"ggml has no CPU dot product for type {number}"):
            torch.ops.kvwire.ggml_matmul(torch.randn(1, 64), q.blocks, number, 64)


def _file_rss_kb(path):
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_a_repacked_tensor_gives_its_file_pages_back(tmp_path):
    """Repacking copies a tensor's blocks; the file's pages it read then leave the process's
    memory (`GGUFFile.forget`), so x16 costs no more memory than ggml's layout; they read back the same."""
    from gguf import GGMLQuantizationType as Q

    from kvwire.io.gguf import GGUFFile

    from .gguf_families import write_gguf
    from .tiny_models import tiny_hf

    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf("llama", vocab_size=32768, tie_word_embeddings=True), quant=Q.Q4_1)
    gguf = GGUFFile(path)
    _, blocks = gguf.blocks("token_embd.weight")
    assert blocks.nbytes >= 500_000
    before = blocks.copy()  # touches every page
    touched = _file_rss_kb(path)
    gguf.forget(blocks)
    assert (touched - _file_rss_kb(path)) * 1024 >= blocks.nbytes - 2 * 4096  # all but the pages at its ends
    assert (blocks == before).all()  # read again: the file's bytes
    gguf.forget(before)  # not the file's memory: nothing happens
    assert (before == blocks).all()


@needs_x16
def test_a_big_weight_is_repacked_in_chunks_each_released_once_copied(monkeypatch):
    """Repacking goes REPACK_ROWS rows at a time and calls `release(start, stop)` after each chunk (the
    GGUF loader gives those rows' file pages back there: a 178 MB head is never held twice); the
    chunked copy equals the whole one."""
    from kvwire.quant.ggml import GGMLLinear, linear

    w = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    plain = GGMLLinear.quantize(w, "q8_0", kernel="ggml")
    whole = GGMLLinear(plain.blocks, plain.qtype, 64, kernel="x16")
    monkeypatch.setattr(linear, "REPACK_ROWS", 48)  # a multiple of the 16-row groups
    released = []
    chunked = GGMLLinear(plain.blocks, plain.qtype, 64, kernel="x16",
                         release=lambda start, stop: released.append((start, stop)))
    assert released == [(0, 48), (48, 96), (96, 144), (144, 192), (192, 200)]
    assert torch.equal(chunked.blocks, whole.blocks)
    assert torch.equal(chunked.ggml_blocks(), plain.blocks)
