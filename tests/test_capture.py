"""`lm.capture`: activations at named sites == `kw.tap` of the same graph calls run alone, == transformers
forward hooks for sites inside one-call layers (attn_heads, a generic block's residual sites); left
padding marked and zeroed; a steered model's value is the steered one; bad input named."""
import pytest
import torch

import kvwire as kw
from kvwire.layers import SITES

from .conftest import FAMILIES

PROMPTS = [[3, 17, 42, 9, 55, 23], [7, 61, 30], [11, 5, 80, 2]]


@pytest.fixture(scope="module")
def pair():
    hf = FAMILIES["llama"]().eval()
    return hf, kw.from_hf(hf)


@pytest.fixture(scope="module")
def generic_pair():
    hf = FAMILIES["llama"](seed=1).eval()
    return hf, kw.from_hf(hf, generic=True)


def test_capture_equals_tap_of_the_same_sites_prompt_by_prompt(pair):
    _, lm = pair
    cap = lm.capture(PROMPTS, sites=list(SITES), layers=[0, 2], batch_size=2)  # two batches, left-padded
    tapped = kw.tap(lm.backbone, [f"layers.{b}.{s}" for s in SITES for b in (0, 2)], depth="layer")
    assert cap.mask.tolist() == [[True] * 6, [False] * 3 + [True] * 3, [False] * 2 + [True] * 4]
    for i, prompt in enumerate(PROMPTS):
        _, taps = tapped(torch.tensor([prompt]))
        row = cap.row(i)
        for site in SITES:
            for block in (0, 2):
                assert row[(site, block)].shape == (len(prompt), 32)
                torch.testing.assert_close(row[(site, block)], taps[f"layers.{block}.{site}"][0], atol=1e-5, rtol=1e-5)
    pads = cap[("block_out", 2)][1, :3]
    assert pads.abs().max() == 0  # pads zeroed, marked by the mask


def _hf_reads(hf, ids, block):
    """transformers' values at block `block`: the heads (o_proj's input), the block's input and
    output, its MLP's output."""
    seen, layer = {}, hf.model.layers[block]
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.update(attn_heads=a[0])),
             layer.register_forward_pre_hook(lambda m, a, k: seen.update(resid_pre=(a or (k["hidden_states"],))[0]),
                                             with_kwargs=True),
             layer.register_forward_hook(lambda m, a, o: seen.update(block_out=o[0] if isinstance(o, tuple) else o)),
             layer.mlp.register_forward_hook(lambda m, a, o: seen.update(mlp_out=o))]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
def test_inner_sites_equal_transformers_hooks(pair, generic_pair, generic):
    hf, lm = generic_pair if generic else pair
    sites = ["attn_heads", "resid_pre", "mlp_out", "block_out"]  # generic: all but block_out are inside the call
    cap = kw.capture(lm, PROMPTS, sites=sites, layers=[1])
    for i, prompt in enumerate(PROMPTS):
        ref, row = _hf_reads(hf, torch.tensor([prompt]), 1), cap.row(i)
        for site in sites:
            torch.testing.assert_close(row[(site, 1)], ref[site][0], atol=1e-5, rtol=1e-5)


def test_a_steered_model_gives_the_steered_value(pair):
    _, lm = pair
    v = torch.randn(32, generator=torch.Generator().manual_seed(0))
    steered = lm.steer(kw.ControlVector({1: v}), 2.0, site="attn_out")
    plain = lm.capture(PROMPTS[:1], sites="attn_out", layers=[1])[("attn_out", 1)]
    got = steered.capture(PROMPTS[:1], sites="attn_out", layers=[1])[("attn_out", 1)]
    torch.testing.assert_close(got, plain + 2.0 * v, atol=1e-5, rtol=1e-5)


def test_prompt_forms_agree(pair):
    _, lm = pair
    as_tensor = lm.capture(torch.tensor(PROMPTS[:1]), layers="1-2")
    as_list = kw.capture(lm, PROMPTS[0], layers=[1, 2])  # one id list is one prompt
    assert list(as_tensor) == [("block_out", 1), ("block_out", 2)]
    for key in as_tensor:
        assert torch.equal(as_tensor[key], as_list[key])


def test_bad_requests_name_what_was_given(pair):
    _, lm = pair
    with pytest.raises(ValueError, match=r"sites \['resid_post'\] are not sites; expected names from"):
        lm.capture(PROMPTS, sites=["resid_post"])
    with pytest.raises(ValueError, match=r"layer indices \[7\] are not blocks of this model: it has blocks 0-3"):
        lm.capture(PROMPTS, layers=[1, 7])
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty str or list of token ids in \[0, 96\)"):
        lm.capture([[1, 2], [500]])
    with pytest.raises(ValueError, match="sites is empty"):
        lm.capture(PROMPTS, sites=[])
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 0"):
        lm.capture(PROMPTS, batch_size=0)
    with pytest.raises(KeyError, match=r"\('mlp_out', 1\) was not captured"):
        lm.capture(PROMPTS, layers=[1])[("mlp_out", 1)]
