"""One exported ONNX graph holding add, ablate, clamp, SAE feature edits and a gated operation at
different sites == eager, rows with their own runtime inputs included."""
import pytest
import torch

import kvwire as kw
from kvwire.steer.gate import Gate, GatedInsert
from kvwire.steer.layer import Steer

from .conftest import FAMILIES
from .test_sae import random_sae, sae_of
from .tokenizers_for_tests import char_level

pytest.importorskip("onnxruntime")

PROMPTS = ["Hello there", "A", "Some longer prompt, with punctuation!"]


def _steered(tmp_path):
    lm = kw.from_hf(FAMILIES["gemma3"](vocab_size=100))
    lm.tokenizer = char_level()
    g = torch.Generator().manual_seed(0)
    v, d, u, w = (torch.randn(k, 32, generator=g) for k in (1, 2, 1, 1))
    model = (lm.steer(kw.ControlVector({1: v[0] * 2}), 1.0, site="attn_out", when="generated")
             .ablate(d, layers=[0, 2], site="resid_mid")
             .clamp(u, -0.5, 0.5, layers=[1, 3], site="mlp_out", when=(2, 40)))
    sae = sae_of(tmp_path, random_sae(jumprelu=True), hook_name="blocks.2.hook_resid_pre")
    model = model.steer_features(sae, {5: 3.0, 9: 0.0})
    probe = Gate(w[0], layer=1, site="resid_pre", threshold=0.0, sharpness=2.0).probe()
    return lm, model.edit(GatedInsert("layers.1.resid_pre", probe,
                                      {"layers.3.attn_out": Steer(v[0] * 3, 1.0, name="gated")}), depth="layer")


def test_an_exported_graph_with_every_operation_generates_as_eager(tmp_path):
    lm, model = _steered(tmp_path)
    names = set(model.cached.runtime_inputs)
    assert {"steer_strength", "ablate_strength", "clamp_lo", "clamp_hi", "gate_threshold", "gated_strength",
            "sae_f5", "sae_f9"} <= names
    path = tmp_path / "ops.onnx"
    kw.export(model, path, max_length=64)
    onnx_lm = kw.load_exported(path)
    assert onnx_lm.generate(PROMPTS, max_new_tokens=8) == model.generate(PROMPTS, max_new_tokens=8)
    rows = {"steer_strength": torch.tensor([0.0, 2.0, -1.0]), "ablate_strength": torch.tensor([1.0, 0.0, 0.5]),
            "clamp_lo": torch.tensor([-0.1, -5.0, 0.2]), "clamp_hi": torch.tensor([0.1, 5.0, 0.3]),
            "gate_threshold": torch.tensor([-1e9, 1e9, 0.5]), "sae_f5": torch.tensor([0.0, 8.0, 3.0])}
    want = model.generate(PROMPTS, max_new_tokens=8, inputs=rows)
    assert onnx_lm.generate(PROMPTS, max_new_tokens=8, inputs=rows) == want
    assert want != model.generate(PROMPTS, max_new_tokens=8)  # the inputs change something
