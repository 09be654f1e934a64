"""Logits equal to Hugging Face transformers on tiny random configs (fp32)."""
import pytest
import torch

import kvwire as kw

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2

ATOL = 2e-5  # fp32 noise of differently ordered reductions; logits here are O(10)

CASES = {
    "gpt2": lambda: tiny_hf_gpt2(),
    "gpt2-unscaled-attn": lambda: tiny_hf_gpt2(scale_attn_weights=False),
    "gemma3-gqa-window": lambda: tiny_hf_gemma3(),
    "gemma3-mqa": lambda: tiny_hf_gemma3(num_key_value_heads=1),
    "gemma3-mha-final-softcap": lambda: tiny_hf_gemma3(num_key_value_heads=4, final_logit_softcapping=3.0),
    "gemma3-linear-rope": lambda: tiny_hf_gemma3(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "gemma3-layer-types": lambda: tiny_hf_gemma3(layer_types=["full_attention", "sliding_attention"] * 2,
                                                 sliding_window_pattern=None),
}


@pytest.mark.parametrize("length", [23, 70], ids=["dense-attention", "flash-attention"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, length):
    """23 tokens take the dense attention path, 70 the fused kernel (>= FLASH_ROWS query rows)."""
    hf = CASES[case]()
    lm = kw.from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = lm(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_gemma3_window_matters():
    """The sliding window is exercised: the same model without it gives other logits."""
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    windowed = kw.from_hf(tiny_hf_gemma3(sliding_window=4))
    unwindowed = kw.from_hf(tiny_hf_gemma3(sliding_window=64))
    with torch.no_grad():
        assert (windowed(ids) - unwindowed(ids)).abs().max() > 1e-2


def test_gemma3_v4_config_form_reads_the_same():
    """transformers v4's Gemma 3 spelling (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) maps to the config of v5's (rope_parameters per layer type, layer_types)."""
    from kvwire.models import gemma3

    hf = tiny_hf_gemma3(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=500.0)
    v5 = hf.config.to_dict()
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")}
    full, local = dict(v5["rope_parameters"]["full_attention"]), v5["rope_parameters"]["sliding_attention"]
    v4.update(rope_theta=full.pop("rope_theta"), rope_local_base_freq=local["rope_theta"], rope_scaling=full,
              sliding_window_pattern=2)
    config = gemma3.config_from_hf(v5)
    assert gemma3.config_from_hf(v4) == config
    assert config.local_rope_theta == 500.0 and config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.layer_types == ("sliding_attention", "full_attention") * 2


def test_gemma3_sliding_layers_are_never_scaled():
    from kvwire.models import gemma3

    d = tiny_hf_gemma3().config.to_dict()
    d["rope_parameters"] = {**d["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="sliding layers' rope .*linear.* is scaled; Gemma 3 rotates them unscaled"):
        gemma3.config_from_hf(d)
