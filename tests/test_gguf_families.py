"""tests/gguf_families.py writes GGUF files that transformers' own GGUF loader reads back to the source model.

What transformers 5.24's loader does not read, a hand-written inverse reads from the file and hands
it in as config fields, so each of those keys is still checked by the logits:
- qwen3: `attention.key_length` (it keeps Qwen3Config's head_dim of 128);
- phi3: `rope.dimension_count` (partial rotary), `rope.scaling.*`, `attention.sliding_window` and the
  rope_factors_long/short tensors (longrope);
- gemma2: the two soft-caps; the query scale is not in the file at all (llama.cpp takes head_dim);
- every architecture's `rope.scaling.*` keys, and llama's rope_freqs tensor (checked against
  transformers' llama3 frequencies instead, as a config cannot be rebuilt from it).
transformers reads a llama-architecture file as Mistral only when general.name is exactly "mistral",
and then fails (gguf-py has no mistral architecture), so mistral files load as llama, as real ones do.
"""
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, Keys
from gguf.quants import dequantize

from .gguf_families import FAMILIES, unpermute, write_gguf
from .tiny_models import tiny_hf

Q = GGMLQuantizationType
LONGROPE = dict(max_position_embeddings=256, original_max_position_embeddings=64,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "long_factor": [1.0, 1.5], "short_factor": [1.1, 0.9]})
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
CASES = {  # id -> (family, tiny_hf overrides); the byte-level and sentencepiece vocabularies need 300 ids
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=None)),  # windowed: see test_what_llama_cpp_cannot_say_raises
    "qwen2": ("qwen2", {}),
    "qwen2-yarn": ("qwen2", dict(rope_parameters=YARN)),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", dict(partial_rotary_factor=0.5)),
    "phi3-longrope": ("phi3", LONGROPE),
    "gemma2": ("gemma2", {}),
}


def _model(case):
    family, overrides = CASES[case]
    return tiny_hf(family, vocab_size=300, **overrides)


def _read(path):
    """(metadata, {tensor name: dequantised array in numpy (rows, cols) order}) of a GGUF file."""
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
               for t in reader.tensors}
    return meta, tensors


# --- the hand-written inverse of what transformers' loader skips -----------------------------

def _rope_scaling(meta, arch):
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None:
        return {}
    rope = {"rope_type": kind, "rope_theta": meta[f"{arch}.rope.freq_base"],
            "factor": meta[f"{arch}.rope.scaling.factor"]}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = meta[f"{arch}.rope.scaling.original_context_length"]
    return {"rope_parameters": rope}


def _phi3(meta, tensors):
    heads, width = meta["phi3.attention.head_count"], meta["phi3.embedding_length"]
    rope = {"rope_type": "default", "rope_theta": meta["phi3.rope.freq_base"],
            "partial_rotary_factor": meta["phi3.rope.dimension_count"] * heads / width}
    if "rope_factors_long.weight" in tensors:
        rope |= {"rope_type": "longrope", "long_factor": tensors["rope_factors_long.weight"].tolist(),
                 "short_factor": tensors["rope_factors_short.weight"].tolist()}
    return {"rope_parameters": rope, "sliding_window": meta["phi3.attention.sliding_window"] or None,
            "original_max_position_embeddings": meta["phi3.rope.scaling.original_context_length"]}


UNREAD = {
    "qwen3": lambda meta, tensors: {"head_dim": meta["qwen3.attention.key_length"]},
    "phi3": _phi3,
    "gemma2": lambda meta, tensors: {"attn_logit_softcapping": meta["gemma2.attn_logit_softcapping"],
                                     "final_logit_softcapping": meta["gemma2.final_logit_softcapping"],
                                     "query_pre_attn_scalar": meta["gemma2.attention.key_length"]},
}


def _transformers_load(path):
    """transformers' own GGUF loader (it dequantises), with the fields it skips read back by hand."""
    from transformers import AutoModelForCausalLM

    meta, tensors = _read(path)
    arch = meta["general.architecture"]
    fields = _rope_scaling(meta, arch) | UNREAD.get(arch, lambda *_: {})(meta, tensors)
    model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                       output_loading_info=True, **fields)
    assert not any(info.values()), info  # every weight came from the file, with its shape
    return model.eval(), fields


def _logits(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_reads_the_file_back_to_the_source_model(tmp_path, case):
    hf = _model(case)
    stored = write_gguf(tmp_path / "x.gguf", hf)
    source = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight" or not hf.config.tie_word_embeddings}
    assert stored.keys() == source.keys()
    for key in source:  # F32 keeps every value (Gemma's norms up to the +1 and back)
        torch.testing.assert_close(stored[key], source[key], atol=1e-6, rtol=0)
    theirs, fields = _transformers_load(tmp_path / "x.gguf")
    assert type(theirs).__name__ == ("LlamaForCausalLM" if case == "mistral" else type(hf).__name__)
    for name, value in fields.items():  # what the hand-written inverse read is what the source says
        expected = getattr(hf.config, name)
        for key, read in (value.items() if name == "rope_parameters" else [(None, value)]):
            said = expected if key is None else expected[key]
            assert read == (pytest.approx(said, rel=1e-6) if isinstance(said, (int, float, list)) else said), (name, key)
    torch.testing.assert_close(_logits(theirs), _logits(hf), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case, quant", [("llama", Q.Q8_0), ("llama", Q.Q4_0), ("phi3", Q.Q8_0), ("gemma2", Q.Q8_0)],
                         ids=lambda v: getattr(v, "name", v))
def test_quantised_file_holds_the_rounded_weights(tmp_path, case, quant):
    hf = _model(case)
    stored = write_gguf(tmp_path / "x.gguf", hf, quant=quant)
    meta, _ = _read(tmp_path / "x.gguf")
    assert meta["general.file_type"] == {Q.Q8_0: 7, Q.Q4_0: 2}[quant]  # llama.cpp's MOSTLY_Q8_0 / MOSTLY_Q4_0
    q = "model.layers.0.self_attn." + ("qkv_proj" if case == "phi3" else "q_proj") + ".weight"
    assert not torch.equal(stored[q], hf.state_dict()[q])  # rounded
    theirs, _ = _transformers_load(tmp_path / "x.gguf")
    hf.load_state_dict(stored, strict=False)
    torch.testing.assert_close(_logits(theirs), _logits(hf), atol=1e-5, rtol=0)


def test_llama_q_and_k_rows_are_permuted(tmp_path):
    hf = _model("llama")
    write_gguf(tmp_path / "x.gguf", hf)
    _, tensors = _read(tmp_path / "x.gguf")
    layer = {k.rsplit(".", 2)[-2]: v.numpy() for k, v in hf.state_dict().items() if k.startswith("model.layers.1.")}
    d = hf.config.head_dim
    for proj, heads in (("q_proj", hf.config.num_attention_heads), ("k_proj", hf.config.num_key_value_heads)):
        ours, theirs = tensors[f"blk.1.attn_{proj[0]}.weight"], layer[proj]
        assert not np.array_equal(ours, theirs)
        # ggml's rope rotates row pairs (2i, 2i + 1) of a head; HF's rotate_half rows (i, i + d/2)
        for h in range(heads):
            np.testing.assert_array_equal(ours[h * d:(h + 1) * d:2], theirs[h * d:h * d + d // 2])
            np.testing.assert_array_equal(ours[h * d + 1:(h + 1) * d:2], theirs[h * d + d // 2:(h + 1) * d])
        np.testing.assert_array_equal(unpermute(ours, heads), theirs)
    assert not np.array_equal(unpermute(tensors["blk.1.attn_k.weight"], 4), layer["k_proj"])  # n_head_kv, not n_head
    np.testing.assert_array_equal(tensors["blk.1.attn_v.weight"], layer["v_proj"])


def test_phi3_keeps_qkv_and_gate_up_fused(tmp_path):
    hf = _model("phi3-partial-rotary")
    write_gguf(tmp_path / "x.gguf", hf)
    meta, tensors = _read(tmp_path / "x.gguf")
    layer = {k.rsplit(".", 2)[-2]: v.numpy() for k, v in hf.state_dict().items() if k.startswith("model.layers.2.")}
    np.testing.assert_array_equal(tensors["blk.2.attn_qkv.weight"], layer["qkv_proj"])  # q, k, v rows stacked
    np.testing.assert_array_equal(tensors["blk.2.ffn_up.weight"], layer["gate_up_proj"])  # gate rows, then up
    assert "blk.2.ffn_gate.weight" not in tensors and meta["phi3.rope.dimension_count"] == 4
    assert meta["phi3.attention.sliding_window"] == 0 and "phi3.rope.scaling.attn_factor" not in meta


def test_phi3_longrope_writes_the_factors_and_attention_factor(tmp_path):
    hf = _model("phi3-longrope")
    write_gguf(tmp_path / "x.gguf", hf)
    meta, tensors = _read(tmp_path / "x.gguf")
    np.testing.assert_allclose(tensors["rope_factors_long.weight"], [1.0, 1.5])
    np.testing.assert_allclose(tensors["rope_factors_short.weight"], [1.1, 0.9], rtol=1e-6)
    assert meta["phi3.rope.scaling.original_context_length"] == 64
    assert meta["phi3.rope.scaling.attn_factor"] == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    assert meta["phi3.rope.scaling.attn_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)), rel=1e-6)


def test_llama3_rope_freqs_divide_the_base_frequencies(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # one frequency of each regime
    hf = tiny_hf("llama", vocab_size=300, rope_parameters=rope)
    write_gguf(tmp_path / "x.gguf", hf)
    meta, tensors = _read(tmp_path / "x.gguf")
    divisors = tensors["rope_freqs.weight"]
    assert divisors[0] == 1.0 and 1.0 < divisors[1] < 8.0 and list(divisors[2:]) == [8.0, 8.0]
    base = 1.0 / 10000.0 ** (np.arange(0, 8, 2, dtype=np.float32) / 8)
    np.testing.assert_allclose(base / divisors, hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    assert "llama.rope.scaling.type" not in meta  # llama3 travels as the tensor alone


def _gguf_key_names(arch):
    names = set()
    for group in (g for g in vars(Keys).values() if isinstance(g, type)):
        names |= {v.replace("{arch}", arch) for k, v in vars(group).items() if k.isupper() and isinstance(v, str)}
    return names


@pytest.mark.parametrize("case", ["llama", "qwen2-yarn", "qwen3", "phi3-longrope", "gemma2"])
def test_every_key_is_one_gguf_py_names(tmp_path, case):
    write_gguf(tmp_path / "x.gguf", _model(case))
    meta, _ = _read(tmp_path / "x.gguf")
    assert set(meta) <= _gguf_key_names(meta["general.architecture"]), set(meta) - _gguf_key_names(meta["general.architecture"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_builds_the_tokenizer(tmp_path, family):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "x.gguf", _model(family))
    meta, _ = _read(tmp_path / "x.gguf")
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == (FAMILIES[family].tokenizer, FAMILIES[family].pre)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="x.gguf")
    ids = tok("the cat in the hat")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "the cat in the hat"
    assert (ids[0] == 2) == FAMILIES[family].add_bos  # <bos> is id 2 in both vocabularies
    assert {"\u0120the", "\u2581the"} & set(tok.convert_ids_to_tokens(ids))  # the merges are used


@pytest.mark.parametrize("make, kwargs, match", [
    (lambda: tiny_hf("mistral", vocab_size=300), {}, "sliding_window=5, but llama.cpp's llama architecture has no window"),
    (lambda: tiny_hf("qwen2", vocab_size=300, use_sliding_window=True, sliding_window=4,
                     max_window_layers=2), {}, "sliding_window=4"),
    (lambda: tiny_hf("llama"), {}, "vocab_size 96 is too small for a byte-level vocabulary of 264"),
    (lambda: tiny_hf("phi3"), {}, "vocab_size 96 is too small for a sentencepiece vocabulary"),
    (lambda: tiny_hf("olmo2", vocab_size=300), {}, "no GGUF layout for model_type 'olmo2'"),
    (lambda: tiny_hf("mistral", vocab_size=300, sliding_window=None), dict(arch="mistral"),
     "mistral is written as GGUF architecture 'llama', not 'mistral'"),
    (lambda: tiny_hf("gemma2", vocab_size=300, query_pre_attn_scalar=16), {}, "query_pre_attn_scalar=16"),
    (lambda: tiny_hf("llama", vocab_size=300, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     {}, "rope_type 'dynamic' has no llama.cpp layout"),
], ids=["mistral-window", "qwen2-window", "byte-vocab", "sp-vocab", "olmo2", "arch", "gemma2-scale", "rope"])
def test_what_llama_cpp_cannot_say_raises(tmp_path, make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_gguf(tmp_path / "x.gguf", make(), **kwargs)
