"""GGUF loading: layouts, dequantisation, tokenizers, and clear errors on bad files."""
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import kvwire as kw

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2
from .gguf_files import STRING, GGUFParts, write_gemma3, write_gpt2

QUANTS = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0]
UINT32, INT32, FLOAT32 = 4, 5, 6  # GGUF value types


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))


def _logits_match(lm, hf, stored):
    hf.load_state_dict(stored, strict=False)  # the values the file really holds, after rounding
    ids = torch.randint(0, hf.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_gemma3_gguf_matches_transformers(tmp_path, quant):
    # GGUF files carry no sliding pattern; llama.cpp and transformers both assume Gemma 3's 5:1.
    hf = tiny_hf_gemma3(vocab_size=300, num_hidden_layers=6, sliding_window_pattern=6)
    stored = write_gemma3(tmp_path / "g.gguf", hf, quant)
    lm = kw.load(tmp_path / "g.gguf", progress=False)
    assert lm.config.layer_types == tuple(hf.config.layer_types) and lm.config.sliding_window == 4
    _logits_match(lm, hf, stored)
    again = kw.load(tmp_path / "g.gguf", progress=False)  # from the disk cache
    _logits_match(again, hf, stored)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_gpt2_gguf_matches_transformers(tmp_path, quant):
    hf = tiny_hf_gpt2(vocab_size=300)
    stored = write_gpt2(tmp_path / "g.gguf", hf, quant)
    _logits_match(kw.load(tmp_path / "g.gguf", progress=False), hf, stored)


TEXTS = ["the and an", "  two  spaces\tand tab\nnew line\n\n", "caf\u00e9 na\u00efve", "\u4f60\u597d\u4e16\u754c",
         "emoji \U0001F600!", "<bos> looks special <eos>", "ther in the"]


@pytest.mark.parametrize("writer,make", [(write_gemma3, tiny_hf_gemma3), (write_gpt2, tiny_hf_gpt2)],
                         ids=["sentencepiece", "byte-level"])
def test_gguf_tokenizer_matches_transformers(tmp_path, writer, make):
    from transformers import AutoTokenizer

    writer(tmp_path / "t.gguf", make(vocab_size=300))
    ours = kw.load(tmp_path / "t.gguf", progress=False).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in TEXTS:
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_bos=False) == expected, text
        assert ours.decode(ours.encode(text, add_bos=False), skip_special_tokens=False) == text


def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "g.gguf"
    write_gpt2(path, tiny_hf_gpt2(vocab_size=300))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        kw.load(path, progress=False)
    path.write_bytes(data[:100])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        kw.load(path, progress=False)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, not a model")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        kw.load(path, progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'mamba'.*supported: \\['gemma2', 'gemma3', 'gpt2', 'llama', 'phi3', 'qwen2', 'qwen3'\\]"):
        kw.load(path, progress=False)


def test_unsupported_tensor_type_is_named(tmp_path):
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    raw = np.zeros((1, size), dtype=np.uint8)
    extra = ("blk.0.extra.weight", raw, GGMLQuantizationType.Q8_1, (1, size))  # one block
    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300), extra_tensor=extra)
    with pytest.raises(ValueError, match="'blk.0.extra.weight' has type Q8_1"):
        kw.load(tmp_path / "g.gguf", progress=False)


def test_cached_weights_per_dtype(tmp_path):
    hf = tiny_hf_gpt2(vocab_size=300)
    write_gpt2(tmp_path / "g.gguf", hf)
    full = kw.load(tmp_path / "g.gguf", progress=False)
    half = kw.load(tmp_path / "g.gguf", dtype="bfloat16", progress=False)
    assert list((tmp_path / "cache").glob("*/weights-bfloat16.safetensors"))
    again = kw.load(tmp_path / "g.gguf", dtype="bfloat16", progress=False)
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert half.head.weight.dtype == torch.bfloat16
        torch.testing.assert_close(again(ids), half(ids), atol=0, rtol=0)
        torch.testing.assert_close(half(ids).float(), full(ids), atol=0.5, rtol=0.05)


def test_a_first_load_in_bfloat16_caches_that_dtype_too(tmp_path):
    """Converting a GGUF for a bfloat16 load writes the bfloat16 file with the float32 one, so the
    second load maps it (no float32 pass over the whole model) and equals the first."""
    hf = tiny_hf_gpt2(vocab_size=300)
    write_gpt2(tmp_path / "g.gguf", hf)
    first = kw.load(tmp_path / "g.gguf", dtype="bfloat16", progress=False)
    [half] = (tmp_path / "cache").glob("*/weights-bfloat16.safetensors")
    assert list(half.parent.glob("weights.safetensors"))
    written = half.stat().st_mtime_ns
    again = kw.load(tmp_path / "g.gguf", dtype="bfloat16", progress=False)
    assert half.stat().st_mtime_ns == written  # mapped, not converted again
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), first(ids), atol=0, rtol=0)


@pytest.mark.parametrize("alignment, message", [
    (0, "general.alignment = 0 is not a positive power of two"),
    (48, "general.alignment = 48 is not a positive power of two"),
    (1 << 31, "general.alignment = 2147483648 puts the tensor data at 2147483648, past the end of the file"),
])
def test_bad_alignment_is_a_clear_error(tmp_path, alignment, message):
    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300))
    GGUFParts(tmp_path / "g.gguf").set("general.alignment", UINT32, alignment).write(tmp_path / "a.gguf")
    with pytest.raises(ValueError, match=f"a.gguf is not a readable GGUF file: {message}"):
        kw.load(tmp_path / "a.gguf", progress=False)


def test_any_power_of_two_alignment_loads(tmp_path):
    hf = tiny_hf_gpt2(vocab_size=300)
    stored = write_gpt2(tmp_path / "g.gguf", hf)
    for alignment in (1, 64, 4096):
        path = GGUFParts(tmp_path / "g.gguf").set("general.alignment", UINT32, alignment) \
            .write(tmp_path / f"a{alignment}.gguf", alignment=alignment)
        _logits_match(kw.load(path, progress=False), hf, stored)


@pytest.mark.parametrize("writer, make, arch", [(write_gemma3, tiny_hf_gemma3, "gemma3"),
                                                (write_gpt2, tiny_hf_gpt2, "gpt2")], ids=["gemma3", "gpt2"])
def test_missing_context_length_names_the_file_and_key(tmp_path, writer, make, arch):
    writer(tmp_path / "g.gguf", make(vocab_size=300))
    GGUFParts(tmp_path / "g.gguf").drop(f"{arch}.context_length").write(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=f"m.gguf has no '{arch}.context_length', which a {arch} model needs"):
        kw.load(tmp_path / "m.gguf", progress=False)


def test_gguf_rope_scaling_gemma3_does_not_implement_is_refused(tmp_path):
    write_gemma3(tmp_path / "g.gguf", tiny_hf_gemma3(vocab_size=300))
    parts = GGUFParts(tmp_path / "g.gguf").set("gemma3.rope.scaling.factor", FLOAT32, 4.0)
    parts.set("gemma3.rope.scaling.type", STRING, "yarn").write(tmp_path / "yarn.gguf")
    with pytest.raises(ValueError, match=r"yarn.gguf: gemma3.rope.scaling.type = 'yarn' is not supported "
                                         r"\(kvwire reads 'none' and 'linear' for this architecture\)"):
        kw.load(tmp_path / "yarn.gguf", progress=False)
    with pytest.raises(ValueError, match="rope_scaling .*yarn.* is not supported"):  # as config.json's
        kw.models.gemma3.config_from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    parts.set("gemma3.rope.scaling.type", STRING, "linear").write(tmp_path / "linear.gguf")
    linear = kw.load(tmp_path / "linear.gguf", progress=False).config
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_a_rewritten_gguf_does_not_load_a_stale_cache_entry(tmp_path):
    path = tmp_path / "g.gguf"
    write_gpt2(path, tiny_hf_gpt2(seed=0, vocab_size=300))
    kw.load(path, progress=False)  # cached
    before = path.stat()
    hf = tiny_hf_gpt2(seed=1, vocab_size=300)
    stored = write_gpt2(path, hf)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # a rewrite within the clock's granularity
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    _logits_match(kw.load(path, progress=False), hf, stored)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.set("gpt2.attention.head_count", STRING, "4"),
     r"gpt2.attention.head_count = '4' \(str\); expected an integer >= 1"),
    (lambda p: p.set("gpt2.attention.head_count", INT32, -4), "gpt2.attention.head_count = -4 .*expected an integer"),
    (lambda p: p.set("gpt2.attention.head_count", UINT32, 5), "n_embd=32 is not a multiple of n_head=5"),
    (lambda p: p.set("gpt2.attention.layer_norm_epsilon", FLOAT32, float("nan")),
     "gpt2.attention.layer_norm_epsilon = nan .*expected a finite number"),
    (lambda p: p.set("gpt2.attention.head_countx", UINT32, 4), r"unknown metadata \['gpt2.attention.head_countx'\]"),
    (lambda p: p.set("tokenizer.ggml.bos_token_id", UINT32, 300),
     r"tokenizer.ggml.bos_token_id = 300 is not a token id \(expected an integer in \[0, 300\)\)"),
    (lambda p: p.set("tokenizer.ggml.tokens", 9, (INT32, [1, 2])), "tokenizer.ggml.tokens must be a list of strings"),
    (lambda p: p.set("tokenizer.ggml.model", STRING, "llama")  # sentencepiece merges from a hostile vocabulary
     .set("tokenizer.ggml.tokens", 9, (STRING, ["<pad>", "a" * 10_000] + [f"t{i}" for i in range(298)])),
     "tokenizer.ggml.tokens are too long to derive merges from"),
])
def test_corrupt_metadata_is_named(tmp_path, edit, message):
    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300))
    edit(GGUFParts(tmp_path / "g.gguf")).write(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match=f"bad.gguf.*{message}"):
        kw.load(tmp_path / "bad.gguf", progress=False)


def test_a_lowered_tensor_count_is_caught(tmp_path):
    """One tensor fewer in the header, its bytes still in the file (a corrupt count)."""
    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300))
    parts = GGUFParts(tmp_path / "g.gguf")
    dropped = parts.tensors.pop()
    (tmp_path / "bad.gguf").write_bytes(parts.to_bytes() + dropped[3])
    with pytest.raises(ValueError, match="bad.gguf is not a readable GGUF file: 128 bytes follow the last tensor"):
        kw.load(tmp_path / "bad.gguf", progress=False)


def test_a_tensor_type_rewritten_in_the_padding_slack_is_caught(tmp_path):
    """An 8-value F32 norm (32 bytes) read as F16 keeps the layout (16 bytes pad to 32): the
    padding, now holding half the float values, gives it away."""
    write_gemma3(tmp_path / "g.gguf", tiny_hf_gemma3(vocab_size=300))
    parts = GGUFParts(tmp_path / "g.gguf")
    start, _ = parts.region("ttype", "blk.0.attn_q_norm.weight")
    data = bytearray((tmp_path / "g.gguf").read_bytes())
    data[start:start + 4] = (1).to_bytes(4, "little")  # F32 -> F16
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="the padding after tensor 'blk.0.attn_q_norm.weight' .* is not zero"):
        kw.load(tmp_path / "bad.gguf", progress=False)


def test_long_string_arrays_read_lazily_equal_the_gguf_package(tmp_path):
    """Arrays of >= 1024 strings are walked at open and decoded when read (`Strings`): the values
    are gguf's own, bad UTF-8 is replaced as before, and a file cut anywhere inside the array is
    the same clear error as for a short one."""
    from gguf import GGUFReader, GGUFWriter

    from kvwire.io.gguf import GGUFFile
    from kvwire.io.gguf_header import LAZY_STRINGS, GGUFError, Strings

    rng = np.random.default_rng(0)
    words = ["".join(chr(c) for c in rng.integers(32, 0x3000, size=rng.integers(1, 9))) for _ in range(3000)]
    path = tmp_path / "strings.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.words", words)
    w.add_array("test.short", words[:LAZY_STRINGS - 1])
    w.add_tensor("t", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    lazy, short = f.field("test.words"), f.field("test.short")
    assert isinstance(lazy, Strings) and type(short) is list
    reader = GGUFReader(str(path))
    theirs = [str(bytes(reader.fields["test.words"].parts[i]), "utf-8") for i in reader.fields["test.words"].data]
    assert list(lazy) == theirs == words and lazy == words and len(lazy) == 3000
    assert lazy[-1] == words[-1] and lazy[5:8] == words[5:8]
    with pytest.raises(IndexError):
        lazy[3000]
    data = bytearray(path.read_bytes())
    where = data.index(b"".join(len(x.encode()).to_bytes(8, "little") + x.encode() for x in words[1499:1501])) + 8
    where += len(words[1499].encode()) + 8  # the first byte of words[1500]
    data[where:where + 1] = b"\xff"  # invalid UTF-8 inside one word: replaced, as short arrays are
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    bad = GGUFFile(tmp_path / "bad.gguf").field("test.words")
    assert "\ufffd" in bad[1500] and bad[1499] == words[1499] and bad[1501] == words[1501]
    for cut in (where - 3, where, where + 5):
        (tmp_path / "cut.gguf").write_bytes(bytes(data[:cut]))
        with pytest.raises(GGUFError, match=r"the value of 'test.words' needs \d+ bytes at offset \d+, but the file "
                                            rf"ends at {cut} \(truncated\?\)"):
            GGUFFile(tmp_path / "cut.gguf")
