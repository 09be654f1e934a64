"""GGUF block formats on ggml's kernels: the bytes mean what the gguf package says they mean, the
kernel computes with them, a GGUF file's own blocks land in the right layers (rows included), and
bad requests fail clearly."""
import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import kvwire as kw
from kvwire.layers import TokenEmbedding

from .conftest import FAMILIES, tiny_hf_gemma3, tiny_hf_gpt2
from .gguf_families import write_gguf
from .gguf_files import write_gemma3, write_gpt2
from .tiny_models import tiny_hf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="ggml kernels need llama-cpp-python (kvwire[ggml])")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))


# relative error of the stored weight on Gaussian values (measured, torch 2.13's generator: q8_0
# 0.54 %, q5_0 4.3 %, q5_1 3.8 %, q4_0 8.6 %, q4_1 7.8 %, q4_k 7.2 %, q6_k 1.8 %), bounded with margin;
# q4_1 / q5_1 (a scale and a minimum a block) pair with Q8_1 activations, the others with Q8_0 / Q8_K
FORMATS = {"q8_0": 0.01, "q5_0": 0.05, "q5_1": 0.05, "q4_0": 0.1, "q4_1": 0.1, "q4_k": 0.1, "q6_k": 0.03}


@pytest.mark.parametrize("name, max_rel", FORMATS.items())
def test_blocks_mean_what_the_gguf_package_says(name, max_rel):
    from kvwire.quant.ggml import GGMLLinear

    w = torch.randn(24, 512, generator=torch.Generator().manual_seed(0))
    q = GGMLLinear.quantize(w, name)
    ours = q.dequantize()
    # the gguf package's numpy decoder is an independent reading of the same bytes
    reference = dequantize(q.ggml_blocks().numpy(), q.qtype).reshape(24, 512)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(reference)))
    assert ((ours - w).norm() / w.norm()).item() < max_rel


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_forward_equals_dequantized_matmul(name, rows):
    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.ggml.linear import MANY_ROWS, UNTILED

    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(48, 256, generator=g), torch.randn(48, generator=g), torch.randn(rows, 256, generator=g)
    q = GGMLLinear.quantize(w, name, bias=b)
    expected = x @ q.dequantize().t() + b
    got = q(x.view(1, rows, 256))
    assert got.shape == (1, rows, 48)
    # ggml's kernels (the row loop at 1-2 rows, ggml's graph from 3) quantise activations to 8 bits per
    # block as llama.cpp does, ~0.5 % relative error; many rows of a format without a tiled kernel:
    # float32 GEMM on the dequantised weight (not Q4_1 on x16, whose kernel wins at every row count)
    dequantized = rows > MANY_ROWS and q.qtype in UNTILED and not q.repacked
    tol = 1e-4 if dequantized else 0.02 * expected.abs().max().item()
    torch.testing.assert_close(got[0], expected, atol=tol, rtol=0)


@pytest.mark.parametrize("name", FORMATS)
def test_the_row_loop_and_ggmls_graph_compute_the_same_products(name):
    """matmul.c picks the row loop or ggml's graph by row count; both read the same blocks and the
    same 8-bit activations, so they agree to float32 summation order, fused weights included."""
    import ctypes

    from kvwire.quant.ggml import GGMLLinear
    from kvwire.kernels.ggml.lib import library

    g = torch.Generator().manual_seed(3)
    qs = [GGMLLinear.quantize(torch.randn(out, 256, generator=g), kind) for out, kind in [(72, name), (40, "q8_0")]]
    x = torch.randn(5, 256, generator=g)
    lib, P, I64 = library(), ctypes.c_void_p, ctypes.c_int64

    def run(fn, types, blocks):
        ys = [torch.full((5, q.out_features), float("nan")) for q in qs]
        rc = fn(2, (ctypes.c_int * 2)(*types), (P * 2)(*[b.data_ptr() for b in blocks]),
                (I64 * 2)(*[q.out_features for q in qs]), I64(256), P(x.data_ptr()), I64(5),
                (P * 2)(*[y.data_ptr() for y in ys]), 2)
        assert rc == 0
        return ys

    # the loop runs the kernels' own layout (x16 for Q4_1 where the CPU has it), ggml's graph ggml's
    plain = [q.ggml_blocks() for q in qs]
    for loop, graph in zip(run(lib.kvw_loop_matmuls, [q.kernel_type for q in qs], [q.blocks for q in qs]),
                           run(lib.kvw_graph_matmuls, [int(q.qtype) for q in qs], plain)):
        torch.testing.assert_close(graph, loop, atol=1e-5 * loop.abs().max().item(), rtol=0)
    for rows in (1, 2, 3, 7, 8, 33):  # every row count the dispatch separates, through the operator
        xr = torch.randn(rows, 256, generator=g)
        expected = xr @ qs[0].dequantize().t()
        got = torch.ops.kvwire.ggml_matmul(xr, qs[0].blocks, qs[0].kernel_type, 256)
        torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_one_fused_call_equals_separate_calls():
    from kvwire.quant.ggml import GGMLLinear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 256, generator=g)
    # mixed partner formats: Q5_0 / Q8_0 take 8-bit Q8_0 activations, Q4_K / Q6_K take Q8_K
    qs = [GGMLLinear.quantize(torch.randn(out, 256, generator=g), name)
          for out, name in [(40, "q5_0"), (17, "q4_k"), (64, "q8_0"), (5, "q6_k")]]
    fused = torch.ops.kvwire.ggml_matmuls(x, [q.blocks for q in qs], [q.kernel_type for q in qs], 256)
    for q, y in zip(qs, fused):
        assert torch.equal(y, torch.ops.kvwire.ggml_matmul(x, q.blocks, q.kernel_type, 256))
    with pytest.raises(RuntimeError, match="expected 1 to 8 weights with a type each, got 2 weights and 1"):
        torch.ops.kvwire.ggml_matmuls(x, [qs[0].blocks, qs[1].blocks], [qs[0].kernel_type], 256)
    with pytest.raises(RuntimeError, match=r"expected contiguous \(out, 144\) uint8 blocks for 256 weights"):
        torch.ops.kvwire.ggml_matmul(x, qs[0].blocks, qs[1].kernel_type, 256)  # Q5_0 blocks read as Q4_K
    with pytest.raises(RuntimeError, match=r"expected x of shape \(rows, 256\) float32, got \[3, 128\]"):
        torch.ops.kvwire.ggml_matmul(x[:, :128], qs[0].blocks, qs[0].kernel_type, 256)
    # a width that is not whole blocks: ggml itself would abort the process
    with pytest.raises(RuntimeError, match="packs 32 weights a block; in_features = 250 is not a positive multiple"):
        torch.ops.kvwire.ggml_matmul(x[:, :250].contiguous(), qs[0].blocks, qs[0].kernel_type, 250)


def test_requantize_equals_quantizing_the_dequantized_weight():
    from kvwire.quant.ggml import GGMLLinear

    g = torch.Generator().manual_seed(4)
    q = GGMLLinear.quantize(torch.randn(16384 + 7, 64, generator=g), "q8_0")  # more than one chunk
    r = q.requantize("q5_0")
    assert r.qtype.name == "Q5_0" and r.blocks.shape[0] == 16384 + 7
    assert torch.equal(r.blocks, GGMLLinear.quantize(q.dequantize(), "q5_0").blocks)
    with pytest.raises(ValueError, match="kvwire quantises to q8_0, .*; got iq4_nl"):
        q.requantize("iq4_nl")


@pytest.mark.parametrize("name", ["q8_0", "q5_0", "q4_1", "q4_k", "q6_k"])
@pytest.mark.parametrize("kernel", ["ggml", "x16"])
def test_rows_are_the_dequantized_weights_rows(name, kernel):
    """An embedding's lookup on blocks: exactly the rows `dequantize` gives, in either layout (x16's
    300 rows end in a group of 12), for ids of any shape; a bad id is an IndexError naming it."""
    from kvwire.quant.ggml import GGMLLinear
    from kvwire.kernels.ggml.lib import x16_runs
    from kvwire.quant.ggml.linear import X16

    if kernel == "x16" and not x16_runs():
        pytest.skip("the x16 kernel needs AVX-512 F, BW, VL and VNNI, or AVX2, which this CPU lacks")
    q = GGMLLinear.quantize(torch.randn(300, 256), name, kernel=kernel)
    assert q.repacked == (kernel == "x16" and q.qtype in X16 and x16_runs(int(q.qtype)))
    ids = torch.tensor([[299, 0, 17], [288, 17, 150]])
    assert torch.equal(q.rows(ids), q.dequantize()[ids])
    assert q.rows(torch.tensor([], dtype=torch.long)).shape == (0, 256)
    assert torch.equal(q.rows(torch.tensor([5], dtype=torch.int32)), q.dequantize()[5:6])
    for bad in (300, -1):
        with pytest.raises(IndexError, match=rf"token id {bad} is out of range for an embedding table of 300 rows"):
            q.rows(torch.tensor([[3, bad]]))
    with pytest.raises(RuntimeError, match="expected integer token ids, got Float"):
        q.rows(torch.tensor([1.0]))


@pytest.mark.parametrize("writer, make", [(write_gemma3, tiny_hf_gemma3), (write_gpt2, tiny_hf_gpt2)],
                         ids=["gemma3", "gpt2"])
def test_a_gguf_models_embedding_reads_the_files_table_not_the_float_copy(tmp_path, writer, make):
    """With quantize="gguf" the token embedding looks its rows up in the file's own blocks (memory-mapped,
    ggml's layout): the float table is never read, so poisoning it changes nothing."""
    writer(tmp_path / "m.gguf", make(vocab_size=300), Q.Q8_0)
    lm = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="q5_0")
    embedding = next(m for m in lm.backbone.modules() if isinstance(m, TokenEmbedding))
    assert embedding.quantized.qtype == Q.Q8_0 and not embedding.quantized.repacked
    ids = torch.tensor([[5, 17, 42, 9, 299]])
    float_lm = kw.load(tmp_path / "m.gguf", progress=False)
    float_embedding = next(m for m in float_lm.backbone.modules() if isinstance(m, TokenEmbedding))
    assert torch.equal(embedding(ids), float_embedding(ids))  # the float table was dequantised from these blocks
    before = lm.generate(ids, max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    embedding.weight = torch.nn.Parameter(torch.full_like(embedding.weight, float("nan")), requires_grad=False)
    lm.reset_caches()
    after = lm.generate(ids, max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    assert after.tokens == before.tokens and after.logprobs == before.logprobs


def test_a_gguf_head_is_requantized_from_its_blocks_not_the_float_table(tmp_path, monkeypatch):
    from kvwire.quant.ggml import GGMLLinear

    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    lm = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf")
    expected = GGMLLinear.quantize(lm.head.quantized.dequantize(), "q5_0").blocks

    def refuse(*args, **kwargs):
        raise AssertionError("the head was quantised from its float weight")

    monkeypatch.setattr(GGMLLinear, "quantize", refuse)
    kw.quantize(lm, "q5_0", layers=False)
    assert lm.head.quantized.qtype.name == "Q5_0" and torch.equal(lm.head.quantized.blocks, expected)
    _rollout_equals_cached(lm, torch.tensor([[5, 17, 42, 9]]))


def test_models_on_ggml_blocks_prefill_in_smaller_calls(tmp_path):
    """Quantised for memory: a prompt's activations are bounded by 256-token calls (float: 512)."""
    from kvwire.quant.ggml.apply import PREFILL_CALL_TOKENS

    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    assert kw.load(tmp_path / "m.gguf", progress=False).prefill_call_tokens is None
    assert kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf").prefill_call_tokens == PREFILL_CALL_TOKENS
    lm = kw.from_hf(tiny_hf_gemma3(vocab_size=300))
    assert kw.quantize(lm, "q8_0", layers=False).prefill_call_tokens is None  # the head alone: layers stay float
    assert kw.quantize(lm, "q8_0").prefill_call_tokens == PREFILL_CALL_TOKENS == 256
    for bad in (0, -3, 2.5, True):
        lm.prefill_call_tokens = bad
        with pytest.raises(ValueError, match=rf"prefill_call_tokens must be an int >= 1 .*got {bad!r}"):
            lm.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=2)


def test_a_gguf_load_gives_back_the_float_files_pages_once_its_head_runs_on_blocks(tmp_path, monkeypatch):
    """The float weights file a GGUF load maps is mostly unread once the linear maps and head run on the
    GGUF's blocks: its pages go back (the float tensors still read: norms); a head left
    float reads the whole table every step, so nothing goes back then."""
    import sys

    load_module = sys.modules["kvwire.load"]
    asked = []
    monkeypatch.setattr(load_module, "give_back_file_pages", lambda tensors: asked.append(list(tensors)) or 0)
    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    kw.load(tmp_path / "m.gguf", progress=False)
    assert not asked  # float: every page is read
    lm = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf")
    assert len(asked) == 1 and asked[0] and all(t.is_floating_point() for t in asked[0])
    assert any(t is lm.backbone.embed_tokens.weight for t in asked[0])
    asked.clear()
    apply_module = sys.modules["kvwire.quant.ggml.apply"]
    real = apply_module.use_gguf_blocks

    def float_head(lm, *args, **kwargs):
        lm = real(lm, *args, **kwargs)
        lm.head.quantized = None
        return lm
    monkeypatch.setattr(load_module, "use_gguf_blocks", float_head)
    kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf")
    assert not asked


def test_load_requantizes_the_head_straight_from_the_file_chunk_by_chunk(tmp_path, monkeypatch):
    """`kw.load(..., quantize="gguf", head="q5_0")` gives the blocks `kw.quantize(lm, "q5_0",
    layers=False)` gives after loading, read from the file's blocks a chunk of rows at a time with
    each chunk's pages given back (the file's head is never held whole); the embedding is untouched."""
    from kvwire.io.gguf import GGUFFile
    from kvwire.quant.ggml import linear

    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    reference = kw.quantize(kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf"), "q5_0", layers=False)
    forgotten = []
    real_forget = GGUFFile.forget
    monkeypatch.setattr(GGUFFile, "forget", lambda self, a: (forgotten.append(a.shape[0]), real_forget(self, a)))
    real_quantized = linear.GGMLLinear._quantized.__func__

    def in_chunks_of_128(cls, rows_of, *args, **kwargs):  # 300 rows: three chunks
        return real_quantized(cls, lambda start, stop: torch.cat([rows_of(a, min(a + 128, stop))
                                                                   for a in range(start, stop, 128)]), *args, **kwargs)
    monkeypatch.setattr(linear.GGMLLinear, "_quantized", classmethod(in_chunks_of_128))
    lm = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="q5_0")
    assert lm.head.quantized.qtype.name == "Q5_0"
    assert torch.equal(lm.head.quantized.ggml_blocks(), reference.head.quantized.ggml_blocks())
    assert forgotten[-4:] == [128, 128, 300 - 256, 300]  # the head's chunks went back as read, then all of it
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        assert torch.equal(lm(ids), reference(ids))
    _rollout_equals_cached(lm, ids)


def test_a_bad_head_at_load_is_a_clear_error(tmp_path):
    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    with pytest.raises(ValueError, match=r"head='q5_0' re-quantises a GGUF's own head at load and needs "
                                         r"quantize='gguf', got quantize=None; .*kw.quantize\(lm, 'q5_0', layers=False\)"):
        kw.load(tmp_path / "m.gguf", progress=False, head="q5_0")
    with pytest.raises(ValueError, match="head='iq4_nl' is not a ggml type kvwire quantises to; expected one of q8_0, "):
        kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="iq4_nl")
    with pytest.raises(ValueError, match="head='fast' is not a ggml type"):
        kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="fast")


def test_a_saved_ggml_linear_runs_in_a_fresh_process(tmp_path):
    import subprocess
    import sys

    from kvwire.quant.ggml import GGMLLinear

    q = GGMLLinear.quantize(torch.randn(8, 64), "q8_0")
    x = torch.randn(2, 64)
    torch.save({"q": q, "x": x, "y": q(x)}, tmp_path / "q.pt")
    # unpickling skips __init__, which is where the operator's kernel library gets loaded
    code = (f"import torch, kvwire; d = torch.load({str(tmp_path / 'q.pt')!r}, weights_only=False); "
            "assert torch.equal(d['q'](d['x']), d['y'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_k_quants_fall_back_on_rows_that_are_not_whole_blocks(tiny_lm):
    kw.quantize(tiny_lm, "q4_k")  # rows of 32 / 64 inputs: no 256-weight K-quant block fits
    kinds = {m.qtype.name for m in tiny_lm.modules() if type(m).__name__ == "GGMLLinear"}
    assert kinds == {"Q5_0"}


def _rollout_equals_cached(lm, ids, steps=5):
    out = lm.generate(ids, max_new_tokens=steps, ignore_eos=True, return_logprobs=True)
    rollout = ids
    for _ in range(steps):  # uncached greedy rollout through the same layers
        rollout = torch.cat([rollout, lm(rollout)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tokens[0] == rollout[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("writer, make", [(write_gemma3, tiny_hf_gemma3), (write_gpt2, tiny_hf_gpt2)],
                         ids=["gemma3", "gpt2"])
def test_gguf_blocks_land_in_the_right_layers(tmp_path, writer, make):
    from kvwire.quant.ggml import GGMLLinear

    writer(tmp_path / "m.gguf", make(vocab_size=300), Q.Q8_0)
    float_lm = kw.load(tmp_path / "m.gguf", progress=False)  # the file's values, dequantised
    lm = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf")
    swapped = _linears_on_blocks(lm)
    assert not [n for n, m in lm.backbone.named_modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(lm.head.quantized, GGMLLinear)
    assert torch.equal(_table_of(lm).dequantize(), float_lm.head.weight)  # the embedding's lookups
    # every weight, GPT-2's split q/k/v rows included, is exactly the file's value for that weight
    for name, module in swapped.items():
        assert torch.equal(module.dequantize(), float_lm.backbone.get_submodule(name).weight), name
        if module.bias is not None:
            assert torch.equal(module.bias, float_lm.backbone.get_submodule(name).bias), name
    assert torch.equal(lm.head.quantized.dequantize(), float_lm.head.weight)
    ids = torch.tensor([[5, 17, 42, 9, 55, 23, 8]])
    with torch.no_grad():
        a, b = lm(ids), float_lm(ids)
    assert ((a - b).norm() / b.norm()).item() < 0.02  # only the 8-bit activations differ
    _rollout_equals_cached(lm, ids)


def _linears_on_blocks(lm):
    """{name: GGMLLinear} of the backbone's linear maps (not the embedding's table)."""
    from kvwire.quant.ggml import GGMLLinear

    return {n: m for n, m in lm.backbone.named_modules() if isinstance(m, GGMLLinear) and not n.endswith(".quantized")}


def _table_of(lm):
    """The GGMLLinear a GGUF model's token embedding looks its rows up in."""
    return next(m for m in lm.backbone.modules() if isinstance(m, TokenEmbedding)).quantized


def _tiny_llama_gguf(path, quant):
    """A tiny llama GGUF laid out as SmolLM2-135M-Instruct's: tied embeddings (the head is token_embd),
    no q/k norms, every 2-D weight in `quant` blocks."""
    write_gguf(path, tiny_hf("llama", vocab_size=300, tie_word_embeddings=True), quant=quant)
    return kw.load(path, progress=False), kw.load(path, progress=False, quantize="gguf")


@pytest.mark.parametrize("quant", [Q.Q4_1, Q.Q8_0], ids=["q4_1", "q8_0"])
def test_llama_gguf_blocks_with_a_tied_head(tmp_path, quant):
    from kvwire.quant.ggml import GGMLLinear

    float_lm, lm = _tiny_llama_gguf(tmp_path / "m.gguf", quant)
    swapped = _linears_on_blocks(lm)
    assert len(swapped) == 7 * lm.config.num_hidden_layers and {m.qtype for m in swapped.values()} == {quant}
    assert not [n for n, m in lm.backbone.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, module in swapped.items():  # q/k rows come back through llama.cpp's permutation
        assert torch.equal(module.dequantize(), float_lm.backbone.get_submodule(name).weight), name
    assert lm.head.quantized.qtype == quant == _table_of(lm).qtype  # the embedding table's blocks, read as the head
    assert torch.equal(lm.head.quantized.dequantize(), float_lm.head.weight)
    ids = torch.tensor([[5, 17, 42, 9, 55, 23, 8]])
    with torch.no_grad():
        a, b = lm(ids), float_lm(ids)
    assert ((a - b).norm() / b.norm()).item() < 0.03  # 8-bit activations only (measured q4_1 1.3 %)


def test_llama_gguf_blocks_generate_through_the_cache(tmp_path):
    _, lm = _tiny_llama_gguf(tmp_path / "m.gguf", Q.Q4_1)
    _rollout_equals_cached(lm, torch.tensor([[5, 17, 42, 9, 55]]))


def test_ggml_quantized_model_cached_equals_uncached(family):
    _rollout_equals_cached(kw.quantize(kw.from_hf(FAMILIES[family]()), "q8_0"), torch.tensor([[3, 17, 42, 9, 55]]))


def test_bad_ggml_requests(tmp_path):
    from kvwire.quant.ggml import GGMLLinear

    with pytest.raises(ValueError, match="unknown ggml type 'q3_x'"):
        GGMLLinear.quantize(torch.randn(4, 256), "q3_x")
    with pytest.raises(ValueError, match="kvwire quantises to q8_0, .*; got iq2_xxs"):
        GGMLLinear.quantize(torch.randn(4, 256), "iq2_xxs")  # needs an importance matrix
    with pytest.raises(ValueError, match="Q4_K packs 256 weights a block; a weight with 320 inputs"):
        GGMLLinear.quantize(torch.randn(4, 320), "q4_k")
    with pytest.raises(ValueError, match=r"expected blocks of shape \(out, 34\) uint8 .* got \(4, 30\)"):
        GGMLLinear(torch.zeros(4, 30, dtype=torch.uint8), Q.Q8_0, 32)
    with pytest.raises(ValueError, match="no CPU dot product for F32"):
        GGMLLinear(torch.zeros(4, 128, dtype=torch.uint8), Q.F32, 32)
    with pytest.raises(ValueError, match="quantize='gguf' keeps a GGUF file's own blocks"):
        kw.load(tmp_path, quantize="gguf")
    write_gpt2(tmp_path / "f.gguf", tiny_hf_gpt2(vocab_size=300), Q.F32)
    with pytest.raises(ValueError, match="holds no quantised linear weights"):
        kw.load(tmp_path / "f.gguf", progress=False, quantize="gguf")


def test_a_ggml_model_is_not_exported(tmp_path):
    lm = kw.quantize(kw.from_hf(FAMILIES["gpt2"]()), "q8_0")
    with pytest.raises(ValueError, match="quantize='gguf'"):
        kw.export(lm, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()


def test_gguf_blocks_of_another_shape_are_refused_before_the_kernels_read_them(tmp_path):
    from kvwire.quant.ggml import use_gguf_blocks

    write_gpt2(tmp_path / "wide.gguf", tiny_hf_gpt2(vocab_size=300, n_embd=64), Q.Q8_0)
    lm = kw.from_hf(tiny_hf_gpt2(vocab_size=300))  # n_embd 32: the file's rows are twice as long
    with pytest.raises(ValueError, match=r"wide.gguf: GGUF tensor 'blk.0.attn_qkv.weight' of dimensions \[64, 192\] "
                                         r"gives 64 rows of 64 for a weight of shape \(32, 32\)"):
        use_gguf_blocks(lm, tmp_path / "wide.gguf")


def test_ggml_quantize_refuses_before_changing_anything():
    lm = kw.from_hf(tiny_hf_gpt2(n_embd=48, n_head=4))  # 48 inputs: not whole 32-weight blocks
    before = {n: type(m) for n, m in lm.named_modules()}
    with pytest.raises(ValueError, match="Q8_0 packs 32 weights a block; a weight with 48 inputs is not a multiple of 32"):
        kw.quantize(lm, "q8_0")
    assert {n: type(m) for n, m in lm.named_modules()} == before and lm.head.quantized is None


def test_the_cli_loads_a_gguf_with_a_requantized_head(tmp_path, capsys):
    from kvwire import cli

    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    model = str(tmp_path / "m.gguf")
    base = ["generate", "hi", "--model", model, "--max-new-tokens", "3"]
    assert cli.main(base + ["--quantize", "gguf", "--head", "q5_0"]) == 0
    assert cli.main(base + ["--head", "q5_0"]) == 2
    assert "head='q5_0' re-quantises a GGUF's own head at load and needs quantize='gguf'" in capsys.readouterr().err
    assert cli.main(base + ["--quantize", "gguf", "--head", "q9"]) == 2
    assert "head='q9' is not a ggml type kvwire quantises to" in capsys.readouterr().err


def test_a_requantized_head_is_kept_for_the_next_load(tmp_path, monkeypatch):
    """The head re-quantised at load is kept beside the converted weights: the next load reads it
    (no quantising) and equals the first; a damaged kept file is made again, not an error."""
    from safetensors.torch import load_file

    from kvwire.quant.ggml import apply

    write_gemma3(tmp_path / "m.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    first = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="q5_0")
    [kept] = (tmp_path / "cache").glob("*/token_embd.weight.q5_0.*.safetensors")

    def refuse(*args):
        raise AssertionError("quantised again")
    with monkeypatch.context() as m:
        m.setattr(apply, "_requantized", refuse)
        again = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="q5_0")
    ids = torch.tensor([[5, 17, 42, 9]])
    assert torch.equal(again.head.quantized.ggml_blocks(), first.head.quantized.ggml_blocks())
    with torch.no_grad():
        assert torch.equal(again(ids), first(ids))
    from safetensors.torch import save_file
    for damaged in (b"not a safetensors file", {"blocks": torch.zeros((), dtype=torch.uint8)},
                    {"blocks": torch.zeros(299, 22, dtype=torch.uint8)}, {"other": torch.zeros(3)}):
        kept.write_bytes(damaged) if isinstance(damaged, bytes) else save_file(damaged, str(kept))
        third = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf", head="q5_0")
        assert torch.equal(third.head.quantized.ggml_blocks(), first.head.quantized.ggml_blocks())
    assert torch.equal(load_file(str(kept))["blocks"], first.head.quantized.blocks)  # written again, as the kernel reads it
