"""Loads on a GGUF file's own blocks (quantize="gguf"): no block is dequantised (only the tensors the
model holds as floats are), the model equals the one made from a float load's weights, the float
cache entries of either kind serve both loads, and blocks copied at load (repacked for x16, rows
reordered) are kept and mapped by the next load, a damaged kept file made again with a warning."""
import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

import kvwire as kw
from kvwire.io import weights_cache

from .gguf_families import write_gguf
from .tiny_models import tiny_hf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="ggml kernels need llama-cpp-python (kvwire[ggml])")
IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))


def _file(tmp_path, quant=Q.Q8_0, tied=False, seed=0, name="m.gguf"):
    """A tiny llama GGUF (Q/K rows permuted as llama.cpp writes them) with every 2-D weight in `quant`."""
    write_gguf(tmp_path / name, tiny_hf("llama", seed=seed, vocab_size=300, tie_word_embeddings=tied), quant=quant)
    return tmp_path / name


def _logits(lm):
    with torch.no_grad():
        return lm(IDS)


def _reference(path, monkeypatch, tmp_path):
    """Logits of a quantize="gguf" load made as before: the float load's entry, then the file's blocks."""
    with monkeypatch.context() as m:
        m.setenv("KVWIRE_CACHE", str(tmp_path / "reference-cache"))
        kw.load(path, progress=False)
        return _logits(kw.load(path, progress=False, quantize="gguf"))


def _entry(path):
    return weights_cache.entry_for(path)


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_0], ids=["q8_0", "q4_0"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_no_block_is_dequantised_and_the_model_is_the_same(tmp_path, monkeypatch, quant, tied):
    from kvwire.io.gguf import GGUFFile
    from kvwire.quant.ggml import sources

    path = _file(tmp_path, quant, tied)
    expected = _reference(path, monkeypatch, tmp_path)
    read, tables = [], []
    real_tensor, real_table = GGUFFile._tensor, sources._dequantized
    monkeypatch.setattr(GGUFFile, "_tensor", lambda self, name, dims, kind, offset: read.append(Q(kind)) or
                        real_tensor(self, name, dims, kind, offset))
    monkeypatch.setattr(sources, "_dequantized", lambda gguf, name: tables.append(name) or real_table(gguf, name))
    for _ in range(2):  # converting, then from the cache entry
        lm = kw.load(path, progress=False, quantize="gguf")
        assert torch.equal(_logits(lm), expected)
    # no block is read as floats but the embedding table (and an untied head), once: the float copies
    # the model holds but does not read while they run on blocks
    assert quant not in read and read
    assert sorted(tables) == (["token_embd.weight"] if tied else ["output.weight", "token_embd.weight"])
    entry = _entry(path)
    assert weights_cache.is_complete(entry, weights_cache.FLOATS) and not weights_cache.is_complete(entry)
    assert not (entry / "weights.safetensors").exists()
    with safe_open(str(entry / "floats.safetensors"), "pt") as f:
        kept = set(f.keys())
    assert {k for k in kept if k.endswith("_proj.weight")} == set()
    assert "embed_tokens.weight" in kept and ("lm_head.weight" in kept) is not tied
    float_lm = kw.load(path, progress=False)  # the float tables equal a float load's
    assert torch.equal(lm.backbone.embed_tokens.weight, float_lm.backbone.embed_tokens.weight)
    assert torch.equal(lm.head.weight, float_lm.head.weight)


def test_float_tables_ggml_decodes_otherwise_take_the_gguf_packages_values(tmp_path, monkeypatch):
    from kvwire.quant.ggml import GGMLLinear

    path = _file(tmp_path)
    with monkeypatch.context() as m:  # a decoder that disagrees with the gguf package at the ends
        m.setattr(GGMLLinear, "dequantize", lambda self: torch.zeros(self.out_features, self.in_features))
        lm = kw.load(path, progress=False, quantize="gguf")
    float_lm = kw.load(path, progress=False)
    assert torch.equal(lm.backbone.embed_tokens.weight, float_lm.backbone.embed_tokens.weight)
    assert torch.equal(lm.head.weight, float_lm.head.weight)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the float load's decoding
@pytest.mark.parametrize("tensor", ["blk.1.ffn_down.weight", "blk.0.attn_q.weight"])
def test_an_infinite_scale_in_blocks_is_refused_as_a_float_load_refuses_it(tmp_path, tensor):
    from kvwire.io.gguf import GGUFFile

    path = _file(tmp_path)
    offset = next(o for name, _, _, o in GGUFFile(path).infos if name == tensor)
    data = bytearray(path.read_bytes())
    data[offset + 34:offset + 36] = np.float16(np.inf).tobytes()  # the second Q8_0 block's scale
    path.write_bytes(bytes(data))
    for quantize in ("gguf", None, "gguf"):
        with pytest.raises(ValueError, match=r"m\.gguf: tensor '.*' holds NaN or infinite values"):
            kw.load(path, progress=False, quantize=quantize)
    assert not weights_cache.is_complete(_entry(path), weights_cache.FLOATS)


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2", "gpt2"])
def test_other_families_on_blocks_are_the_same_model(tmp_path, monkeypatch, family):
    """Phi-3's fused rows split, Gemma's norm offset, GPT-2's fused q/k/v and biases: as before."""
    from .conftest import tiny_hf_gpt2
    from .gguf_files import write_gpt2

    path = tmp_path / "m.gguf"
    if family == "gpt2":
        write_gpt2(path, tiny_hf_gpt2(vocab_size=300), Q.Q8_0)
    else:
        write_gguf(path, tiny_hf(family, vocab_size=300), quant=Q.Q8_0)
    expected = _reference(path, monkeypatch, tmp_path)
    for _ in range(2):
        assert torch.equal(_logits(kw.load(path, progress=False, quantize="gguf")), expected)
    assert not weights_cache.is_complete(_entry(path))


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_0], ids=["q8_0", "q4_0"])
def test_sibling_projections_run_as_one_call_with_the_same_numbers(tmp_path, monkeypatch, quant):
    """Eager q/k/v and gate/up on blocks run as one `ggml_matmuls` call each (`products.siblings`),
    bit for bit the separate calls' logits, prompt and decode; a hooked projection runs as it is."""
    from kvwire.kernels import products

    lm = kw.load(_file(tmp_path, quant), progress=False, quantize="gguf")
    fusable, fused = products._fusable, []

    def counting(x, modules):
        found = fusable(x, modules)
        fused.append(found is not None)
        return found

    def both():
        with torch.no_grad():
            return _logits(lm), lm.generate(IDS, max_new_tokens=6, ignore_eos=True)

    monkeypatch.setattr(products, "_fusable", counting)
    logits, tokens = both()
    assert fused and all(fused)  # every layer's q/k/v and gate/up, prompt and decode
    monkeypatch.setattr(products, "_fusable", lambda x, modules: None)
    separate_logits, separate_tokens = both()
    assert torch.equal(logits, separate_logits)
    assert [t.tolist() for t in tokens] == [t.tolist() for t in separate_tokens]

    k_proj = lm.backbone.layers[0].self_attn.k_proj
    handle = k_proj.register_forward_hook(lambda module, args, out: out + 1)
    monkeypatch.setattr(products, "_fusable", counting)
    fused.clear()
    hooked = _logits(lm)
    assert not fused[0] and all(fused[1:])  # the hooked layer's q/k/v run apart, its gate/up together
    handle.remove()
    monkeypatch.setattr(products, "_fusable", lambda x, modules: None)
    k_proj.register_forward_hook(lambda module, args, out: out + 1)
    assert torch.equal(hooked, _logits(lm)) and not torch.equal(hooked, logits)


def test_a_float_load_after_one_on_blocks_and_one_on_blocks_after_it(tmp_path, monkeypatch):
    path = _file(tmp_path)
    expected = _reference(path, monkeypatch, tmp_path)
    with monkeypatch.context() as m:
        m.setenv("KVWIRE_CACHE", str(tmp_path / "float-cache"))
        float_logits = _logits(kw.load(path, progress=False))
    assert torch.equal(_logits(kw.load(path, progress=False, quantize="gguf")), expected)
    assert torch.equal(_logits(kw.load(path, progress=False)), float_logits)  # converts every tensor now
    assert weights_cache.is_complete(_entry(path))
    assert torch.equal(_logits(kw.load(path, progress=False, quantize="gguf")), expected)  # on the float entry


def test_a_bfloat16_load_on_blocks_maps_its_own_floats(tmp_path, monkeypatch):
    path = _file(tmp_path)
    with monkeypatch.context() as m:
        m.setenv("KVWIRE_CACHE", str(tmp_path / "reference-cache"))
        kw.load(path, progress=False, dtype="bfloat16")
        expected = _logits(kw.load(path, progress=False, quantize="gguf", dtype="bfloat16"))
    for _ in range(2):
        lm = kw.load(path, progress=False, quantize="gguf", dtype="bfloat16")
        assert lm.backbone.embed_tokens.weight.dtype == torch.bfloat16 and torch.equal(_logits(lm), expected)
    assert (_entry(path) / "floats-bfloat16.safetensors").is_file()


def _no_repacking(monkeypatch):
    from kvwire.quant.ggml import linear

    def refuse(*args, **kwargs):
        raise AssertionError("repacked again")
    monkeypatch.setattr(linear, "_repacked", refuse)


def _copied(lm):
    from kvwire.quant.ggml import GGMLLinear

    return [m for m in lm.backbone.modules() if isinstance(m, GGMLLinear) and m.repacked]


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_0], ids=["q8_0", "q4_0"])
def test_copied_blocks_are_kept_and_mapped_by_the_next_load(tmp_path, monkeypatch, quant):
    """Q8_0 is repacked for x16 where that kernel runs; Q4_0 keeps ggml's layout, but llama's Q/K rows
    are reordered (a copy) either way: the next load maps both from the kept file."""
    path = _file(tmp_path, quant)
    first = kw.load(path, progress=False, quantize="gguf")
    [kept] = _entry(path).glob("blocks-*.bin")
    with monkeypatch.context() as m:
        _no_repacking(m)
        again = kw.load(path, progress=False, quantize="gguf")
    assert torch.equal(_logits(again), _logits(first))
    q = again.backbone.layers[0].self_attn.q_proj
    assert os.path.samefile(_mapped_file(q.blocks), kept)  # reordered (and repacked) rows: the kept file's
    assert q.repacked == first.backbone.layers[0].self_attn.q_proj.repacked


def _mapped_file(tensor):
    """The file a CPU tensor's memory is mapped from (Linux: /proc/self/maps)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end and len(fields) > 5:
                return fields[5]
    raise AssertionError("not a mapped file")


def _damages():
    def truncate(data, body):
        return data[:-100]

    def header(data, body):
        return data[:20] + bytes([data[20] ^ 1]) + data[21:]

    def tensor_start(data, body):
        return data[:body] + bytes([data[body] ^ 1]) + data[body + 1:]

    def magic(data, body):
        return b"X" + data[1:]

    def empty(data, body):
        return b""
    return [truncate, header, tensor_start, magic, empty]


@pytest.mark.parametrize("damage", _damages(), ids=lambda f: f.__name__)
def test_a_damaged_kept_file_is_made_again_with_a_warning(tmp_path, monkeypatch, damage):
    from kvwire.quant.ggml.packed import _data_start

    path = _file(tmp_path)
    expected = _logits(kw.load(path, progress=False, quantize="gguf"))
    [kept] = _entry(path).glob("blocks-*.bin")
    data = kept.read_bytes()
    body = _data_start(int.from_bytes(data[8:16], "little"))
    kept.write_bytes(damage(data, body))
    with pytest.warns(UserWarning, match=r"blocks-.*\.bin is damaged \(.+\); its blocks are made again"):
        again = kw.load(path, progress=False, quantize="gguf")
    assert torch.equal(_logits(again), expected)
    assert kept.read_bytes() == data  # written again, whole
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("error")
        _no_repacking(m)
        assert torch.equal(_logits(kw.load(path, progress=False, quantize="gguf")), expected)


def test_another_kernel_layout_or_cpu_never_reads_the_kept_blocks(tmp_path, monkeypatch):
    from kvwire.quant.ggml import packed

    path = _file(tmp_path)
    expected = _logits(kw.load(path, progress=False, quantize="gguf"))
    [kept] = _entry(path).glob("blocks-*.bin")
    real = packed.layout_key()
    monkeypatch.setattr(packed, "layout_key", lambda: "another CPU")
    assert torch.equal(_logits(kw.load(path, progress=False, quantize="gguf")), expected)
    assert len(list(_entry(path).glob("blocks-*.bin"))) == 2  # a file of its own
    # a file named for this layout whose header names another: refused, made again
    monkeypatch.setattr(packed, "layout_key", lambda: real)
    other = next(p for p in _entry(path).glob("blocks-*.bin") if p != kept)
    os.replace(other, kept)
    with pytest.warns(UserWarning, match="written for another kernel layout or CPU"):
        assert torch.equal(_logits(kw.load(path, progress=False, quantize="gguf")), expected)


def test_the_ggml_kernel_switch_never_reads_x16_blocks(tmp_path, monkeypatch):
    from kvwire.kernels.cpu import ggml_kernel

    if ggml_kernel() != "x16":
        pytest.skip("x16's kernel does not run on this CPU")
    path = _file(tmp_path)
    assert _copied(kw.load(path, progress=False, quantize="gguf"))
    monkeypatch.setenv("KVWIRE_GGML_KERNEL", "ggml")
    lm = kw.load(path, progress=False, quantize="gguf")
    assert not _copied(lm)
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "fresh"))
    assert torch.equal(_logits(lm), _logits(kw.load(path, progress=False, quantize="gguf")))


def test_a_file_rewritten_in_place_never_reads_the_old_files_blocks(tmp_path):
    path = _file(tmp_path, seed=0)
    first = _logits(kw.load(path, progress=False, quantize="gguf"))
    stat = path.stat()
    _file(tmp_path, seed=1)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and time: only the contents differ
    got = _logits(kw.load(path, progress=False, quantize="gguf"))
    assert not torch.equal(got, first)
    fresh = tmp_path / "copy"
    fresh.mkdir()
    os.replace(path, fresh / "m.gguf")
    assert torch.equal(got, _logits(kw.load(fresh / "m.gguf", progress=False, quantize="gguf")))
