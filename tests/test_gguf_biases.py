"""Biases in llama GGUF files: llama.cpp's `llama` reads the bias of q, k, v, attn_output, ffn_gate,
ffn_up and ffn_down wherever a block has one, each on its own. kvwire loads the same model: a group
(q/k/v, o, gate/up) is on where any block has one of its tensors, with zeros where a block has none,
and ffn_down's bias is on exactly the blocks that have it. The source transformers model (its
missing biases deleted) is the arbiter, and llama.cpp where it is installed."""
import importlib.util

import numpy as np
import pytest
import torch

import kvwire as kw
from kvwire.models.decoder import DecoderConfig, gguf_biases

from .gguf_families import write_gguf
from .tiny_models import tiny_hf

IDS = torch.tensor([[3, 17, 42, 9, 55, 23, 7, 61, 30]])
ALL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
       "mlp.up_proj", "mlp.down_proj")
# (block, module) pairs whose bias the file leaves out
CASES = {
    "every-bias": [],
    "some-blocks-lack-some": [(1, "self_attn.k_proj"), (0, "self_attn.o_proj"), (2, "mlp.up_proj"),
                              (0, "mlp.down_proj"), (3, "mlp.down_proj")],
    "only-o-and-gate": [(i, m) for i in range(4) for m in ALL if m not in ("self_attn.o_proj", "mlp.gate_proj")]
    + [(2, "self_attn.o_proj")],
    "only-q": [(i, m) for i in range(4) for m in ALL if m != "self_attn.q_proj"],
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))


def _biased_llama(left_out):
    hf = tiny_hf("llama", vocab_size=300, attention_bias=True, mlp_bias=True)
    for i, name in left_out:  # computed without it, as llama.cpp computes a block whose file lacks it
        hf.model.layers[i].get_submodule(name).bias = None
    return hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_kvwire_reads_every_bias_a_llama_block_carries(case, tmp_path):
    hf = _biased_llama(CASES[case])
    path = tmp_path / "m.gguf"
    write_gguf(path, hf)
    with torch.no_grad():
        want = hf(IDS).logits
    lm = kw.load(path, progress=False)
    torch.testing.assert_close(lm(IDS), want, atol=1e-4, rtol=1e-4)
    downs = [b.mlp.down_proj.bias is not None for b in lm.backbone.layers]
    assert downs == [(i, "mlp.down_proj") not in CASES[case] for i in range(4)]  # none made up as zeros
    for i, block in enumerate(lm.backbone.layers):  # the rest: the file's values, or zeros it left out
        for name in ALL[:-1]:
            ours, theirs = block.get_submodule(name).bias, hf.model.layers[i].get_submodule(name).bias
            if theirs is not None:
                assert ours is not None, (i, name)
            elif ours is not None:
                assert not ours.any(), (i, name)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python (kvwire[ggml])")
def test_llama_cpp_reads_the_same_biases(tmp_path):
    """llama.cpp on the same file gives the source model's logits: what kvwire reads is what it reads."""
    from llama_cpp import Llama

    hf = _biased_llama(CASES["some-blocks-lack-some"])
    write_gguf(tmp_path / "m.gguf", hf)
    llm = Llama(str(tmp_path / "m.gguf"), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(IDS[0].tolist())
    theirs = torch.tensor(np.array(llm.scores[IDS.shape[1] - 1]))
    with torch.no_grad():
        want = hf(IDS).logits[0, -1]
    torch.testing.assert_close(theirs, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(kw.load(tmp_path / "m.gguf", progress=False)(IDS)[0, -1], want, atol=1e-4, rtol=1e-4)


def test_bias_fields_from_tensor_names():
    names = ["blk.0.attn_k.bias", "blk.2.ffn_down.bias", "blk.2.ffn_down.weight", "blk.1.ffn_up.bias"]
    assert gguf_biases(names, 3) == {"attention_bias": True, "attention_out_bias": False, "mlp_bias": True,
                                     "mlp_out_bias": (False, False, True)}
    assert gguf_biases(["blk.0.attn_q.weight"], 3)["mlp_out_bias"] is False


@pytest.mark.parametrize("value, match", [
    ((True, False), r"mlp_out_bias=\(True, False\); expected true, false or 3 of them \(one per layer\)"),
    ((1, 0, 1), r"mlp_out_bias=\(1, 0, 1\); expected"),
    ("yes", r"mlp_out_bias='yes'; expected"),
])
def test_a_bad_per_layer_bias_is_refused_naming_it(value, match):
    sizes = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**sizes, mlp_out_bias=value)
    assert DecoderConfig(**sizes, mlp_bias=True).mlp_out_bias == (True,) * 3
    assert DecoderConfig(**sizes, mlp_out_bias=[False, True, False]).mlp_out_bias == (False, True, False)
