"""GGUF loading: layouts, dequantisation, tokenizers, and clear errors on bad files."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import kvwire as kw

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2
from .gguf_files import write_gemma3, write_gpt2

QUANTS = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0]


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

    path = tmp_path / "llama.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'llama'.*supported: \\['gemma3', 'gpt2'\\]"):
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
