"""The default model on ggml's kernels (`quantize="gguf"`): the file's own blocks land in the
right layers and decode through the cached graph like the uncached forward. Marked `real`."""
import collections
import importlib.util

import pytest
import torch

import kvwire as kw

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="ggml kernels need llama-cpp-python (kvwire[ggml])")]


def test_default_model_runs_its_own_gguf_blocks(default_lm):
    from kvwire.quant.ggml import GGMLLinear

    lm = kw.load("gemma3-270m", quantize="gguf", progress=False)
    swapped = {n: m for n, m in lm.backbone.named_modules() if isinstance(m, GGMLLinear)}
    table = swapped.pop("embed_tokens.quantized")  # the embedding looks its rows up in the file's head
    assert table.qtype.name == "Q8_0" and not table.repacked
    kinds = collections.Counter(m.qtype.name for m in swapped.values())
    # what llama.cpp's Q4_K_M recipe wrote into this file (its loader log: 81 q5_0, 27 q4_K, 9 q6_K,
    # 10 q8_0 tensors, the head being one of the q8_0)
    assert kinds == {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 9}
    assert lm.head.quantized.qtype.name == "Q8_0"
    for name in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "layers.17.self_attn.o_proj"):
        assert torch.equal(swapped[name].dequantize(), default_lm.backbone.get_submodule(name).weight), name
    ids = torch.tensor([lm.tokenizer.encode("The capital of France is")])
    out = lm.generate(ids, max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    rollout = ids
    with torch.no_grad():
        for _ in range(6):  # uncached: the same per-row kernels (every call is at most 32 rows)
            rollout = torch.cat([rollout, lm(rollout)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tokens[0] == rollout[0, ids.shape[1]:].tolist()
    assert lm.tokenizer.decode(out.tokens[0]).strip()
