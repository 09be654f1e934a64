"""Q4_1 blocks repacked for kvwire's AVX-512 VNNI kernel (`q4_1x16.c`): the repacking is lossless,
the kernel computes ggml's products (to float32 summation order) at every row count and shape, and
the choice between it and ggml's own kernel follows the CPU, refusing what the CPU cannot run."""
import copy
import importlib.util

import pytest
import torch

HAVE_GGML = importlib.util.find_spec("llama_cpp") is not None
pytestmark = pytest.mark.skipif(not HAVE_GGML, reason="ggml kernels need llama-cpp-python (kvwire[ggml])")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVWIRE_Q4_1_KERNEL", raising=False)


def _x16_runs():
    from kvwire.quant.ggml.linear import x16_runs

    return x16_runs()


needs_x16 = pytest.mark.skipif("not HAVE_GGML or not _x16_runs()",
                               reason="this CPU lacks AVX-512 F/BW/VL + VNNI: the x16 Q4_1 kernel does not run here")


def _pair(out, n, seed=0):
    """The same Q4_1 weight on ggml's kernel and on x16."""
    from kvwire.quant.ggml import GGMLLinear

    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed))
    return GGMLLinear.quantize(w, "q4_1", kernel="ggml"), GGMLLinear.quantize(w, "q4_1", kernel="x16")


@needs_x16
@pytest.mark.parametrize("out, n", [(48, 256), (37, 576), (16, 32), (1, 1536), (200, 1536)])
def test_repacked_blocks_hold_ggmls_bytes_and_values(out, n):
    from kvwire.quant.ggml.linear import X16

    plain, packed = _pair(out, n)
    assert plain.kernel_type == 3 and packed.kernel_type == X16 and "repacked for x16" in repr(packed)
    assert packed.blocks.shape == plain.blocks.shape
    assert not torch.equal(packed.blocks, plain.blocks) or out == 1 and n == 32  # the layout did change
    assert torch.equal(packed.ggml_blocks(), plain.blocks)  # and back, byte for byte
    assert torch.equal(packed.dequantize(), plain.dequantize())


@needs_x16
@pytest.mark.parametrize("out, n", [(48, 256), (37, 576), (200, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32, 45])
def test_x16_computes_ggmls_products(out, n, rows):
    """Each block's integer dot product and scaling are ggml's: only the float sums' order differs.
    (Past 32 rows ggml's layout dequantises for float32 GEMM; x16 keeps its kernel: the operator.)"""
    plain, packed = _pair(out, n, seed=rows)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(100 + rows))
    expected = torch.ops.kvwire.ggml_matmul(x, plain.blocks, plain.kernel_type, n)
    got = packed(x)
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    assert torch.equal(got, torch.ops.kvwire.ggml_matmul(x, packed.blocks, packed.kernel_type, n))  # x16's op ran
    reference = x @ plain.dequantize().t()  # and both are the float product up to 8-bit activations
    torch.testing.assert_close(got, reference, atol=0.02 * reference.abs().max().item(), rtol=0)


@needs_x16
def test_a_fused_call_mixes_x16_with_other_formats():
    from kvwire.quant.ggml import GGMLLinear

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 576, generator=g)
    qs = [GGMLLinear.quantize(torch.randn(out, 576, generator=g), kind, kernel=kernel)
          for out, kind, kernel in [(40, "q4_1", "x16"), (24, "q8_0", None), (19, "q4_1", "ggml"), (33, "q4_1", "x16")]]
    fused = torch.ops.kvwire.ggml_matmuls(x, [q.blocks for q in qs], [q.kernel_type for q in qs], 576)
    for q, y in zip(qs, fused):
        assert torch.equal(y, torch.ops.kvwire.ggml_matmul(x, q.blocks, q.kernel_type, 576))


@needs_x16
def test_requantize_and_copies_of_a_repacked_weight():
    from kvwire.quant.ggml import GGMLLinear

    plain, packed = _pair(16384 + 21, 64)  # more than one of requantize's 16,384-row chunks
    assert torch.equal(packed.requantize("q8_0").blocks, plain.requantize("q8_0").blocks)
    x = torch.randn(2, 64)
    clone = copy.deepcopy(packed)
    assert clone.kernel_type == packed.kernel_type and torch.equal(clone(x), packed(x))
    assert torch.equal(GGMLLinear(packed.ggml_blocks(), packed.qtype, 64).blocks, packed.blocks)


def test_a_copy_made_where_x16_ran_falls_back_where_it_does_not(monkeypatch):
    """A repacked module unpickled on a CPU without the x16 kernel gets ggml's layout back."""
    from kvwire.quant.ggml import GGMLLinear, linear

    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(6))
    if not linear.x16_runs():
        pytest.skip("this CPU lacks AVX-512 F/BW/VL + VNNI: no repacked module can be made here")
    packed, plain = GGMLLinear.quantize(w, "q4_1", kernel="x16"), GGMLLinear.quantize(w, "q4_1", kernel="ggml")
    monkeypatch.setattr(linear, "x16_runs", lambda: False)
    clone = copy.deepcopy(packed)
    assert clone.kernel_type == 3 and torch.equal(clone.blocks, plain.blocks)
    x = torch.randn(2, 256)
    assert torch.equal(clone(x), plain(x))


def test_the_kernel_follows_the_cpu_and_refuses_what_it_cannot_run(monkeypatch):
    from kvwire.quant.ggml import GGMLLinear, linear

    runs = linear.x16_runs()
    assert linear.q4_1_kernel() == ("x16" if runs else "ggml")
    w = torch.randn(32, 64)
    assert GGMLLinear.quantize(w, "q4_1").kernel_type == (linear.X16 if runs else 3)
    assert GGMLLinear.quantize(w, "q8_0", kernel="x16").kernel_type == 8  # the choice is Q4_1's alone
    monkeypatch.setenv("KVWIRE_Q4_1_KERNEL", "ggml")
    assert GGMLLinear.quantize(w, "q4_1").kernel_type == 3
    monkeypatch.setenv("KVWIRE_Q4_1_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVWIRE_Q4_1_KERNEL='fast'; expected one of x16, ggml"):
        GGMLLinear.quantize(w, "q4_1")
    monkeypatch.delenv("KVWIRE_Q4_1_KERNEL")
    with pytest.raises(ValueError, match="kernel='avx'; expected one of x16, ggml"):
        GGMLLinear.quantize(w, "q4_1", kernel="avx")
    monkeypatch.setattr(linear, "x16_runs", lambda: False)  # a CPU without the features, as on AVX2
    assert linear.q4_1_kernel() == "ggml"
    with pytest.raises(ValueError, match="kernel=x16 needs AVX-512 F, BW and VL with AVX512_VNNI, which this CPU"):
        GGMLLinear.quantize(w, "q4_1", kernel="x16")
    monkeypatch.setenv("KVWIRE_Q4_1_KERNEL", "x16")
    with pytest.raises(ValueError, match="KVWIRE_Q4_1_KERNEL=x16 needs AVX-512"):
        GGMLLinear.quantize(w, "q4_1")


@pytest.mark.skipif("not HAVE_GGML or _x16_runs()", reason="this CPU runs the x16 kernel: its refusal is the AVX2 machines' branch")
def test_the_operator_refuses_repacked_blocks_where_x16_cannot_run():
    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import X16

    q = GGMLLinear.quantize(torch.randn(16, 64), "q4_1")
    with pytest.raises(RuntimeError, match=f"ggml has no CPU dot product for type {X16}"):
        torch.ops.kvwire.ggml_matmul(torch.randn(1, 64), q.blocks, X16, 64)


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
