"""Loading the shared decoder's families from folders, and every bad input a clear error:
unsupported model_type, unknown rope type, contradicting fields, missing or misshapen tensors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvwire as kw
from kvwire.models import FAMILIES, by_hf_model_type

from .tiny_models import tiny_hf


@pytest.mark.parametrize("family", ["llama", "phi3", "olmo2", "gemma2"])
def test_hugging_face_folder_loads_to_transformers_logits(tmp_path, family):
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path)
    lm = kw.load(tmp_path)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=2e-5, rtol=0)


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported Hugging Face model_type 'mamba'; supported: \[.*'gemma2'.*"
                                         r"'llama'.*'olmo2'.*'phi3'.*'qwen3'"):
        by_hf_model_type("mamba")


def test_unknown_rope_type_is_named_with_the_known_ones():
    d = tiny_hf("llama").config.to_dict()
    d["rope_parameters"] = {"rope_type": "wavy", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match=r"rope_type 'wavy' is not supported; expected one of \['default', 'linear', "
                                         r"'dynamic', 'llama3', 'yarn', 'longrope'"):
        FAMILIES["llama"].config_from_hf(d)


def test_unknown_config_field_is_refused():
    d = {**tiny_hf("qwen3").config.to_dict(), "num_experts": 8}
    with pytest.raises(ValueError, match=r"qwen3 config: unknown config fields \['num_experts'\]"):
        FAMILIES["qwen3"].config_from_hf(d)


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["full_attention"] * 3), r"layer_types must list 4 entries \(one per layer\)"),
    (dict(layer_types=["full_attention", "global", "full_attention", "full_attention"]), "layer_types must list"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types has sliding_attention layers but sliding_window is None"),
])
def test_layer_types_contradicting_the_config_are_refused(change, match):
    d = {**tiny_hf("qwen3").config.to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        FAMILIES["qwen3"].config_from_hf(d)


@pytest.mark.parametrize("change, match", [
    (dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(hidden_act="gelu_fast_and_loose"), "unsupported activation 'gelu_fast_and_loose'"),
    (dict(pretraining_tp=2), r"pretraining_tp=2 is not supported \(expected 1\)"),
])
def test_contradicting_or_unsupported_config_is_refused(change, match):
    d = {**tiny_hf("llama").config.to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        FAMILIES["llama"].config_from_hf(d)


def test_gemma2_non_positive_query_scalar_is_refused():
    d = {**tiny_hf("gemma2").config.to_dict(), "query_pre_attn_scalar": 0}
    with pytest.raises(ValueError, match="query_pre_attn_scalar=0; expected a positive number"):
        FAMILIES["gemma2"].config_from_hf(d)


def _folder(tmp_path, family="llama", **config_changes):
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **config_changes}))
    return tmp_path / "model.safetensors"


def test_head_dim_contradicting_the_weights_names_the_tensor_and_both_shapes(tmp_path):
    _folder(tmp_path, head_dim=16)  # 2 key/value heads x 16 = 32 rows; the weights have 2 x 8 = 16
    with pytest.raises(ValueError, match=r"tensor 'layers.0.self_attn.k_proj.weight' has shape \(16, 32\), "
                                         r"expected \(32, 32\)"):
        kw.load(tmp_path)


def _edit_weights(tmp_path, family, edit):
    """A saved tiny checkpoint of `family` whose safetensors state dict `edit` changes in place."""
    weights = _folder(tmp_path, family)
    state = load_file(str(weights))
    edit(state)
    save_file(state, str(weights), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    _edit_weights(tmp_path, "llama", lambda s: s.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \['layers.2.mlp.up_proj.weight'\]"):
        kw.load(tmp_path)


def test_tensor_of_the_wrong_shape_is_named(tmp_path):
    _edit_weights(tmp_path, "qwen2", lambda s: s.update({"model.layers.1.self_attn.k_proj.bias": torch.zeros(5)}))
    with pytest.raises(ValueError, match=r"'layers.1.self_attn.k_proj.bias' has shape \(5,\), expected \(16,\)"):
        kw.load(tmp_path)


def test_fused_phi3_tensor_of_the_wrong_size_is_named(tmp_path):
    _edit_weights(tmp_path, "phi3", lambda s: s.update({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(40, 32)}))
    with pytest.raises(ValueError, match=r"fused tensor 'layers.0.self_attn.qkv_proj.weight' has 40 rows; "
                                         r"expected 64 \(32 \+ 16 \+ 16 for"):
        kw.load(tmp_path)


def test_untied_config_without_an_output_matrix_is_refused(tmp_path):
    _edit_weights(tmp_path, "llama", lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        kw.load(tmp_path)
