"""Activation patching: everything patched recovers 100 %, nothing 0 % (within the measured noise floor);
one (site, block, position) patch == the same patch written with transformers hooks; prompts of
different lengths need a position map; bad input named."""
import pytest
import torch

import kvwire as kw
from kvwire.layers.site import ALL_SITES

from .conftest import FAMILIES
from .serve_fixtures import tiny_chat_lm

CLEAN = [3, 17, 42, 9, 55, 23]
CORRUPTED = [3, 17, 80, 9, 55, 23]  # one token differs
ANSWERS = (2, 90)  # the tokens whose logits the one changed token moves most apart


@pytest.fixture(scope="module")
def pair():
    hf = FAMILIES["llama"]().eval()
    return hf, kw.from_hf(hf)


def test_patching_everything_recovers_all_and_nothing_none(pair):
    _, lm = pair
    everything = [(s, b, None) for s in ALL_SITES for b in range(4)]
    r = kw.patch.run(lm, CLEAN, CORRUPTED, [[], everything, [("block_out", 3, None)]], sites=list(ALL_SITES),
                     answers=ANSWERS, batch_size=2)
    assert abs(r.clean - r.corrupted) > 0.05  # the prompts do differ on the answers
    assert r.noise < 1e-4 and r.noise_floor == pytest.approx(r.noise / abs(r.clean - r.corrupted))
    assert abs(r.recovered[0]) <= r.noise_floor + 1e-5
    torch.testing.assert_close(r.recovered[1:], torch.ones(2), atol=1e-4, rtol=0)
    assert r.sites is None and r.tokens == CORRUPTED


def _hf_logit_diff(hf, module_of, block, position, clean, corrupted, pre, source=None):
    """The logit difference of ANSWERS with transformers, the clean value of `module_of(layer)`'s
    input (pre) or output at `source` (default: `position`) put at `position` of the corrupted run."""
    target, seen = module_of(hf.model.layers[block]), {}

    def value(args, out):
        x = args[0] if pre else out
        return x[0] if isinstance(x, tuple) else x

    def keep(m, a, o=None):
        seen["x"] = value(a, o).clone()

    def put(m, a, o=None):
        x = value(a, o).clone()
        x[:, position] = seen["x"][:, position if source is None else source]
        if pre:
            return (x, *a[1:])
        return (x, *o[1:]) if isinstance(o, tuple) else x

    logits = []
    for ids, hook in ((clean, keep), (corrupted, put)):
        h = target.register_forward_pre_hook(hook) if pre else target.register_forward_hook(hook)
        try:
            with torch.no_grad():
                logits.append(hf(torch.tensor([ids])).logits[0, -1])
        finally:
            h.remove()
    return float(logits[1][ANSWERS[0]] - logits[1][ANSWERS[1]])


def test_one_patch_equals_transformers_hooks(pair):
    hf, lm = pair
    r = kw.patch.sweep(lm, CLEAN, CORRUPTED, ["block_out", "attn_heads", "mlp_out"], [2, -1], layers=[1, 2],
                       answers=ANSWERS, batch_size=5)
    assert r.scores.shape == (3, 2, 2) and r.positions == [2, 5] and r.layers == [1, 2]
    for s, (module_of, pre) in enumerate([(lambda layer: layer, False), (lambda layer: layer.self_attn.o_proj, True),
                                          (lambda layer: layer.mlp, False)]):
        for b, block in enumerate(r.layers):
            for p, position in enumerate(r.positions):
                ref = _hf_logit_diff(hf, module_of, block, position, CLEAN, CORRUPTED, pre)
                assert r.scores[s, b, p].item() == pytest.approx(ref, abs=1e-4), (r.sites[s], block, position)
    torch.testing.assert_close(r.recovered, (r.scores - r.corrupted) / (r.clean - r.corrupted))
    assert r.recovered[0, 1, 0].item() != pytest.approx(0.0, abs=1e-3)  # the patch does move the answer


def test_prompts_of_different_lengths_need_a_position_map(pair):
    hf, lm = pair
    longer = [3, 17, 42, 42, 9, 55, 23]
    with pytest.raises(ValueError, match="the clean prompt has 7 tokens and the corrupted one 6: patching needs a "
                                         "position_map"):
        kw.patch.sweep(lm, longer, CORRUPTED, answers=ANSWERS)
    mapping = {0: 0, 1: 1, 2: 3, 3: 4, 4: 5, 5: 6}  # corrupted position -> clean position
    r = kw.patch.sweep(lm, longer, CORRUPTED, "block_out", [2], layers=[0], answers=ANSWERS, position_map=mapping)
    mapped = _hf_logit_diff(hf, lambda layer: layer, 0, 2, longer, CORRUPTED, False, source=3)
    unmapped = _hf_logit_diff(hf, lambda layer: layer, 0, 2, longer, CORRUPTED, False)
    assert r.scores[0, 0, 0].item() == pytest.approx(mapped, abs=1e-4)
    assert r.scores[0, 0, 0].item() != pytest.approx(unmapped, abs=1e-3)
    with pytest.raises(ValueError, match=r"corrupted position 1 has no clean position in position_map"):
        kw.patch.sweep(lm, longer, CORRUPTED, positions=[1], answers=ANSWERS, position_map=[0, None, 3, 4, 5, 6])


def test_a_metric_function_and_text_answers():
    lm = tiny_chat_lm()
    c, d = (lm.tokenizer.encode(t, add_bos=False)[0] for t in "cd")
    by_text = kw.patch.sweep(lm, "ab cat", "ab dog", "block_out", [-1, 3], layers=[2, 3], answers=("c", "d"))
    by_fn = kw.patch.sweep(lm, "ab cat", "ab dog", "block_out", [-1, 3], layers=[2, 3],
                           metric=lambda logits: logits[:, c] - logits[:, d])
    assert torch.equal(by_text.scores, by_fn.scores)
    with torch.no_grad():
        clean = lm(torch.tensor([lm.encode("ab cat")]))[0, -1]
    assert by_text.clean == pytest.approx(float(clean[c] - clean[d]), abs=1e-5)
    assert by_text.recovered[0, 1, 0].item() == pytest.approx(1.0, abs=1e-4)  # the last block's output, last token
    with pytest.raises(ValueError, match=r"the correct answer ' Paris' is 6 tokens"):
        kw.patch.sweep(lm, "ab cat", "ab dog", answers=(" Paris", "d"))


def test_bad_requests_name_what_was_given(pair):
    _, lm = pair
    with pytest.raises(ValueError, match="give either answers=.* not neither"):
        kw.patch.sweep(lm, CLEAN, CORRUPTED)
    with pytest.raises(ValueError, match=r"the clean and corrupted prompts give the same metric"):
        kw.patch.sweep(lm, CLEAN, CLEAN, layers=[0], answers=ANSWERS)
    with pytest.raises(ValueError, match=r"metric returned shape \(\); expected \(1,\)"):
        kw.patch.sweep(lm, CLEAN, CORRUPTED, positions=[0], layers=[0], metric=lambda logits: logits.sum())
    with pytest.raises(ValueError, match=r"positions must be ints in \[-6, 6\) .* got 9"):
        kw.patch.sweep(lm, CLEAN, CORRUPTED, positions=[9], answers=ANSWERS)
    with pytest.raises(ValueError, match=r"patches\[0\] patches \('mlp_out', 1\), which is not among the sites"):
        kw.patch.run(lm, CLEAN, CORRUPTED, [[("mlp_out", 1, 0)]], answers=ANSWERS)
    with pytest.raises(ValueError, match=r"the incorrect answer must be a token id in \[0, 96\)"):
        kw.patch.sweep(lm, CLEAN, CORRUPTED, answers=(1, 500))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rows_share_the_blocks_below_their_patches(family, monkeypatch):
    lm = kw.from_hf(FAMILIES[family]().eval())
    sites = ["resid_pre", "attn_heads", "block_out"]
    shared = kw.patch.Patcher(lm, CLEAN, CORRUPTED, sites, None, ANSWERS, None, None)
    whole = kw.patch.Patcher(lm, CLEAN, CORRUPTED, sites, None, ANSWERS, None, None, share=False)
    lower_rows = []
    real = shared._cut

    def counted(block):
        cut = real(block)
        return cut if cut is None else (cut[0], lower_rows.append(len(cut[1])) or cut[1])
    monkeypatch.setattr(shared, "_cut", counted)
    got = kw.patch.sweep_with(shared, shared.positions(None), batch_size=7)
    want = kw.patch.sweep_with(whole, whole.positions(None), batch_size=7)
    assert got.scores.shape == (3, 4, 6)
    torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=0)
    assert float(got.scores.std()) > 1e-3  # the patches differ
    assert lower_rows and set(lower_rows) == {1}  # what is below a batch's patches ran for one row
    # rows of any patches come back in their own order, whatever order they ran in
    rows = [[("block_out", 3, None)], [], [("resid_pre", 1, 2), ("block_out", 2, 4)], [("attn_heads", 0, 5)]]
    mixed = shared.run(rows, batch_size=2)
    torch.testing.assert_close(mixed.scores, whole.run(rows, batch_size=2).scores, atol=1e-5, rtol=0)
    assert mixed.recovered[1].abs() <= mixed.noise_floor + 1e-5
