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
