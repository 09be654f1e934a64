"""GGUF files of the shared decoder's architectures, written as llama.cpp writes them (Q/K rows
permuted for llama, Gemma's norm offset folded in, Phi-3's fused tensors, rope factors as tensors),
load to the source transformers model's logits."""
import pytest
import torch
from gguf import GGMLQuantizationType

import kvwire as kw

from .gguf_families import write_gguf
from .test_gguf_families import CASES, LONGROPE, YARN
from .tiny_models import tiny_hf

Q = GGMLQuantizationType
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 1e4}
LOAD_CASES = {**CASES, "llama-llama3": ("llama", dict(rope_parameters=LLAMA3)),
              "llama-yarn": ("llama", dict(rope_parameters=YARN)),
              "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True))}


def _hf(case):
    family, overrides = LOAD_CASES[case]
    return tiny_hf(family, vocab_size=300, **overrides)


def _logits(model, length=40, kvwire=False):
    ids = torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids) if kvwire else model(ids).logits


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_gguf_loads_to_the_source_models_logits(tmp_path, case, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    hf = _hf(case)
    write_gguf(tmp_path / "m.gguf", hf)
    lm = kw.load(tmp_path / "m.gguf", progress=False)
    # 40 tokens; longrope's original context is 64, crossed in the next test
    torch.testing.assert_close(_logits(lm, kvwire=True), _logits(hf), atol=2e-5, rtol=0)
    again = kw.load(tmp_path / "m.gguf", progress=False)  # from the converted-weights cache
    torch.testing.assert_close(_logits(again, kvwire=True), _logits(hf), atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", ["phi3-longrope"])
def test_longrope_gguf_past_its_original_context(tmp_path, case, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    hf = _hf(case)
    write_gguf(tmp_path / "m.gguf", hf)
    lm = kw.load(tmp_path / "m.gguf", progress=False)
    assert LONGROPE["original_max_position_embeddings"] < 100
    torch.testing.assert_close(_logits(lm, 100, kvwire=True), _logits(hf, 100), atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen2", "phi3", "gemma2"])
def test_quantised_gguf_loads_dequantised_and_on_its_own_blocks(tmp_path, case, monkeypatch):
    """Q8_0 files: dequantised weights equal the rounded source; quantize="gguf" runs ggml on the
    file's own blocks (llama's permuted Q/K rows reordered, Phi-3's fused rows split)."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    hf = _hf(case)
    stored = write_gguf(tmp_path / "m.gguf", hf, quant=Q.Q8_0)
    hf.load_state_dict(stored, strict=False)
    expected = _logits(hf)
    torch.testing.assert_close(_logits(kw.load(tmp_path / "m.gguf", progress=False), kvwire=True), expected,
                               atol=2e-5, rtol=0)
    blocks = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf")
    # ggml quantises activations to Q8 for its products (80 rows: ggml's tiled graph; before it ran
    # these rows as float32 GEMM, so this bound only saw the rounded weights): measured largest
    # error over the logits' largest magnitude 1.9 % llama, 1.4 % qwen2, 1.8 % phi3, 5.8 % gemma2
    got = _logits(blocks, kvwire=True)
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_a_cache_entry_whose_config_fields_changed_is_converted_again(tmp_path, monkeypatch):
    """An entry written when the family's config had other fields (Gemma 3's own config class, before
    it became decoder data) is converted again instead of failing to load."""
    import json

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    hf = _hf("gemma2")
    write_gguf(tmp_path / "m.gguf", hf)
    kw.load(tmp_path / "m.gguf", progress=False)
    [saved] = (tmp_path / "cache").glob("*/config.json")
    meta = json.loads(saved.read_text())
    saved.write_text(json.dumps({**meta, "config": {**meta["config"], "sliding_window_pattern": 2}}))
    lm = kw.load(tmp_path / "m.gguf", progress=False)
    torch.testing.assert_close(_logits(lm, kvwire=True), _logits(hf), atol=2e-5, rtol=0)
    assert json.loads(saved.read_text()) == meta  # written again, in the config's current fields
