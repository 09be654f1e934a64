"""Every family of the shared decoder equals transformers' logits on tiny random configs (fp32),
with each of its variations: rope scaling types, partial rotary, sliding layers, soft-caps, norm
placements, multipliers, biases, GQA and MQA, tied and untied heads, v4 and v5 config forms."""
import pytest
import torch

import kvwire as kw
from kvwire.models import FAMILIES

from .tiny_models import tiny_hf

ATOL = 2e-5  # fp32 noise of differently ordered reductions; logits here are O(10)
ORIGINAL = 16  # longrope's original context: lengths 23 and 70 cross it (long factors), 16 does not

CASES = {
    "llama": {},
    "llama-mqa-biases": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "llama-tied": dict(tie_word_embeddings=True),
    "llama-linear": dict(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0}),
    # dynamic NTK only changes positions past max_position_embeddings, which kvwire refuses as past
    # the context: inside it, this pins that it equals transformers (= unscaled)
    "llama-dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "llama-llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                          "rope_theta": 1e4}),
    "llama-yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                        "original_max_position_embeddings": 32}),
    "mistral-window": dict(sliding_window=5),
    "mistral-mha-full": dict(sliding_window=None, num_key_value_heads=4),
    "qwen2": {},
    "qwen2-sliding-layers": dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
    "qwen3": {},
    "qwen3-bias-untied": dict(attention_bias=True, tie_word_embeddings=False),
    "phi3": {},
    "phi3-partial-rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.5}),
    "phi3-longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.5, 2.0, 3.0],
                                           "long_factor": [2.0, 3.0, 5.0, 8.0]},
                          original_max_position_embeddings=ORIGINAL),
    "phi3-window": dict(sliding_window=6),
    "gemma": {},
    "gemma-mqa": dict(num_key_value_heads=1),
    "gemma2": {},
    "gemma2-no-softcap": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
    "olmo2": {},
    "olmo2-gqa1": dict(num_key_value_heads=1),
    "granite": {},
}


def _family(case):
    return case.split("-")[0]


@pytest.mark.parametrize("length", [23, 70], ids=["dense-attention", "flash-attention"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, length):
    """23 tokens take the dense attention path, 70 the fused kernel (>= FLASH_ROWS query rows)."""
    hf = tiny_hf(_family(case), **CASES[case])
    lm = kw.from_hf(hf)
    ids = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = lm(ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_every_family_has_cases():
    new = set(FAMILIES) - {"gpt2", "gemma3"}
    assert new == {_family(c) for c in CASES}, "each decoder family needs parity cases here"


@pytest.mark.parametrize("case", ["llama-llama3", "qwen2-sliding-layers", "phi3-longrope", "gemma2"])
def test_v4_config_form_reads_the_same(case):
    """transformers v4's config.json spelling (rope_theta + rope_scaling) maps to the same config."""
    hf = tiny_hf(_family(case), **CASES[case])
    family = FAMILIES[_family(case)]
    v5 = hf.config.to_dict()
    v4 = dict(v5)
    rope = dict(v4.pop("rope_parameters"))
    v4["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        v4["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        v4["rope_scaling"] = rope
    if case.startswith("qwen2"):
        v4.pop("layer_types")  # v4 files derive it from use_sliding_window / max_window_layers
    assert family.config_from_hf(v4) == family.config_from_hf(v5)


def test_sliding_layers_and_softcaps_matter():
    """The variations are exercised: switching one off changes the logits."""
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    pairs = [("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), {}),
             ("gemma2", {}, dict(attn_logit_softcapping=None)),
             ("granite", {}, dict(residual_multiplier=1.0))]
    for family, a, b in pairs:
        with torch.no_grad():
            first, second = kw.from_hf(tiny_hf(family, **a))(ids), kw.from_hf(tiny_hf(family, **b))(ids)
        assert (first - second).abs().max() > 1e-2, family


def test_longrope_short_factors_inside_the_original_context():
    """Up to the original context Phi-3 uses the short factors (the cases above cross it)."""
    hf = tiny_hf("phi3", **CASES["phi3-longrope"])
    ids = torch.randint(0, 96, (2, ORIGINAL), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(kw.from_hf(hf)(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_one_window_pattern_gives_every_familys_layer_types():
    from kvwire.models.decoder import sliding_layer_types

    full, slide = "full_attention", "sliding_attention"
    assert sliding_layer_types(3) == (slide,) * 3  # Mistral, Phi-3
    assert sliding_layer_types(4, full_every=2) == (slide, full) * 2  # Gemma 2
    assert sliding_layer_types(7, full_every=6) == (slide,) * 5 + (full, slide)  # Gemma 3
    assert sliding_layer_types(4, first_sliding=3) == (full,) * 3 + (slide,)  # Qwen's max_window_layers
    with pytest.raises(ValueError, match=r"num_hidden_layers=1099511627776; expected an integer in \[0, 512\]"):
        sliding_layer_types(2**40, full_every=6)  # a corrupt count, before a huge list is built
