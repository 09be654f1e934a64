"""Steering operations at every block site == the same operation written with transformers forward
hooks on the same tiny model; cached == uncached; rows with different operations == each alone;
position schedules; bad input."""
import pytest
import torch

import kvwire as kw
from kvwire.layers import SITES

from .conftest import FAMILIES
from .test_guards import _rollout

IDS = torch.tensor([[3, 17, 42, 9, 55, 23, 7, 61, 30]])
# sandwich norms (gemma3, olmo2), a residual multiplier (granite), GPT-2's own block, GQA (llama),
# sliding windows shorter than the prompt (gemma3)
OP_FAMILIES = ["llama", "gemma3", "granite", "gpt2", "olmo2"]


# -- references: the operations written plainly, in float64 ------------------------------------------------

def ref_add(x, v, s=1.0):
    return x + s * v


def ref_ablate(x, d, s=1.0):
    d = d.reshape(-1, d.shape[-1]).double()
    proj = d.T @ torch.linalg.pinv(d @ d.T) @ d  # projector onto the span (not kvwire's QR)
    xd = x.double()
    return (xd - s * xd @ proj).to(x.dtype)


def ref_clamp(x, d, lo, hi):
    xd = x.double()
    for u in d.reshape(-1, d.shape[-1]).double():
        u = u / u.norm()
        p = (xd * u).sum(-1, keepdim=True)
        xd = xd + (p.clamp(lo, hi) - p) * u
    return xd.to(x.dtype)


# -- where each site is in a transformers decoder layer ---------------------------------------------------

def _hf_layers(hf):
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def _writers(layer):
    """The modules whose outputs are what attention and the MLP add to the residual stream."""
    attn = layer.attn if hasattr(layer, "attn") else layer.self_attn
    if hasattr(layer, "post_feedforward_layernorm"):  # sandwich / post norms
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return attn, layer.mlp


def hook_site(hf, index, site, op):
    """Install transformers hooks applying `op` (hidden (B, T, D) -> same) at `site` of block `index`.
    Returns the handles."""
    layer = _hf_layers(hf)[index]
    m = getattr(hf.config, "residual_multiplier", 1.0)  # granite scales the writes: the site is after it
    attn_writer, mlp_writer = _writers(layer)
    seen = {}

    def first(value, fn):
        return (fn(value[0]), *value[1:]) if isinstance(value, tuple) else fn(value)

    def keep_input(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen["x"] = x
        if site != "resid_pre":
            return None
        y = op(x)
        return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})

    def on_attn(module, args, out):
        if site == "attn_out":
            return first(out, lambda a: op(a * m) / m)
        if site == "resid_mid":
            return first(out, lambda a: (op(seen["x"] + a * m) - seen["x"]) / m)
        return None

    def on_mlp(module, args, out):
        return first(out, lambda h: op(h * m) / m) if site == "mlp_out" else None

    def on_block(module, args, out):
        return first(out, op) if site == "block_out" else None

    return [layer.register_forward_pre_hook(keep_input, with_kwargs=True),
            attn_writer.register_forward_hook(on_attn), mlp_writer.register_forward_hook(on_mlp),
            layer.register_forward_hook(on_block)]


def hf_logits(hf, ids, hooks):
    handles = [h for index, site, op in hooks for h in hook_site(hf, index, site, op)]
    try:
        with torch.no_grad():
            return hf(ids).logits
    finally:
        for h in handles:
            h.remove()


def _directions(width, k, seed):
    return torch.randn(k, width, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=OP_FAMILIES)
def pair(request):
    hf = FAMILIES[request.param]()
    return hf, kw.from_hf(hf)


# -- each operation at each site == transformers hooks ----------------------------------------------------

@pytest.mark.parametrize("site", SITES)
def test_each_operation_at_each_site_matches_transformers_hooks(pair, site):
    hf, lm = pair
    width = lm.head.weight.shape[1]
    v = _directions(width, 1, 1)[0] * 0.7
    d = _directions(width, 2, 2)
    u = _directions(width, 1, 3)
    cases = [
        (lm.steer(kw.ControlVector({1: v}), 1.5, site=site), [(1, site, lambda x: ref_add(x, v, 1.5))]),
        (lm.ablate(d, layers=[0, 2], site=site),
         [(i, site, lambda x: ref_ablate(x, d)) for i in (0, 2)]),
        (lm.ablate(d[0], layers=[1], site=site, strength=0.5), [(1, site, lambda x: ref_ablate(x, d[0], 0.5))]),
        (lm.clamp(u, 0.1, 0.1, layers=[1, 2], site=site),  # to a value
         [(i, site, lambda x: ref_clamp(x, u, 0.1, 0.1)) for i in (1, 2)]),
        (lm.clamp(d, lo=0.5, layers=[2], site=site), [(2, site, lambda x: ref_clamp(x, d, 0.5, None))]),
        (lm.clamp(u, hi=-3.0, layers=[0], site=site), [(0, site, lambda x: ref_clamp(x, u, None, -3.0))]),
    ]
    plain = hf_logits(hf, IDS, [])
    for model, hooks in cases:
        want = hf_logits(hf, IDS, hooks)
        assert (want - plain).abs().max() > 1e-3  # the operation does something here
        torch.testing.assert_close(model(IDS), want, atol=2e-4, rtol=2e-4)


def test_operations_stack_in_the_order_given(pair):
    hf, lm = pair
    width = lm.head.weight.shape[1]
    v, d = _directions(width, 1, 4)[0], _directions(width, 1, 5)[0]
    model = lm.steer(kw.ControlVector({1: v}), 2.0, site="mlp_out").ablate(d, layers=[1], site="mlp_out")
    want = hf_logits(hf, IDS, [(1, "mlp_out", lambda x: ref_ablate(ref_add(x, v, 2.0), d))])
    torch.testing.assert_close(model(IDS), want, atol=2e-4, rtol=2e-4)


# -- cached == uncached; rows with different operations == each alone ------------------------------------

def _mixed(lm):
    width = lm.head.weight.shape[1]
    v, d, u = _directions(width, 1, 6)[0], _directions(width, 2, 7), _directions(width, 1, 8)
    return (lm.steer(kw.ControlVector({1: v}), 1.5, site="attn_out")
            .ablate(d, layers=[0, 2], site="resid_mid")
            .clamp(u, -0.2, 0.2, layers=[1], site="mlp_out"))


def test_cached_generation_equals_the_uncached_rollout(pair):
    _, lm = pair
    model = _mixed(lm)
    got = model.generate(IDS, max_new_tokens=8, ignore_eos=True)
    assert got[0].tolist() == _rollout(model, IDS, 8)


def test_rows_with_different_operations_equal_each_alone(pair):
    _, lm = pair
    model = _mixed(lm)
    big = torch.finfo(torch.float32).max
    rows = {  # row 0: all on; row 1: all off; row 2: only the clamp, wider
        "steer_strength": torch.tensor([1.5, 0.0, 0.0]), "ablate_strength": torch.tensor([1.0, 0.0, 0.0]),
        "clamp_lo": torch.tensor([-0.2, -big, -0.05]), "clamp_hi": torch.tensor([0.2, big, 0.05])}
    batch = model.generate(IDS.expand(3, -1), max_new_tokens=6, ignore_eos=True, inputs=rows)
    for r in range(3):
        alone = model.generate(IDS, max_new_tokens=6, ignore_eos=True,
                               inputs={k: t[r:r + 1] for k, t in rows.items()})
        assert batch[r].tolist() == alone[0].tolist(), r
    assert batch[1].tolist() == lm.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist()


# -- schedules --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["prompt", "generated", 5, (2, 6)])
def test_schedules_pick_positions(when):
    lm = kw.from_hf(FAMILIES["llama"]())
    d = _directions(lm.head.weight.shape[1], 1, 9)[0]
    model = lm.ablate(d, layers=[1, 2], when=when)
    got = model.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist()
    # the reference: an always-on ablation over exactly the scheduled positions, token by token
    n = IDS.shape[1]
    lo, hi = {"prompt": (0, n), "generated": (n, 10**9)}.get(when, when if isinstance(when, tuple) else (when, 10**9))
    seq = IDS
    for _ in range(6):
        on = lm.ablate(d, layers=[1, 2], when=(lo, hi))  # absolute positions: valid in a plain call
        seq = torch.cat([seq, on(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got == seq[0, n:].tolist()


def test_a_prompt_only_schedule_ends_at_each_rows_prompt():
    lm = kw.from_hf(FAMILIES["llama"]())
    d = _directions(lm.head.weight.shape[1], 1, 10)[0]
    defaults = lm.ablate(d, when="prompt").cached.default_inputs(2, torch.tensor([4, 7]))
    assert defaults["ablate_start"].tolist() == [0, 0] and defaults["ablate_end"].tolist() == [4, 7]


def test_layers_of_one_name_compute_their_mask_once_per_call(monkeypatch):
    """The positions' mask (times the strength) is made once per cached-graph call for every layer of a
    name: 8 ablations and 4 clamps at 4 blocks make 2 masks a call; a plain call makes one a layer."""
    from kvwire.steer import schedule

    lm = kw.from_hf(FAMILIES["llama"]())
    d = _directions(lm.head.weight.shape[1], 1, 12)[0]
    model = lm.ablate(d, site="attn_out").ablate(d, site="mlp_out", name="ablate").clamp(d, -0.1, 0.1)
    made, real = [], schedule.schedule_mask
    monkeypatch.setattr(schedule, "schedule_mask", lambda *args: made.append(args) or real(*args))
    want = model.generate(IDS, max_new_tokens=3, ignore_eos=True)[0].tolist()  # a prefill call and two steps
    assert len(made) == 2 * 3 and {len(args) for args in made} == {4}
    assert [args[3] is None for args in made] == [False, True] * 3  # the ablations' strength; the clamp's none
    made.clear()
    model(IDS)
    assert len(made) == 12
    monkeypatch.setattr(schedule, "schedule_mask", real)
    assert model.generate(IDS, max_new_tokens=3, ignore_eos=True)[0].tolist() == want


# -- bad input --------------------------------------------------------------------------------------------

def test_bad_operations_are_refused_by_name():
    lm = kw.from_hf(FAMILIES["llama"]())
    width = lm.head.weight.shape[1]
    d = torch.randn(width)
    with pytest.raises(ValueError, match=r"site must be one of .*'attn_out'.*got 'attention'"):
        lm.ablate(d, site="attention")
    with pytest.raises(ValueError, match=r"clamp range is inverted: lo 1.0 > hi 0.0; expected lo <= hi"):
        lm.clamp(d, 1.0, 0.0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        lm.ablate(torch.full((width,), float("nan")))
    with pytest.raises(ValueError, match=f"directions width {width + 1} does not fit this model's hidden size {width}"):
        lm.ablate(torch.randn(width + 1))
    with pytest.raises(ValueError, match=r"row 1 lies in the span of the rows before it"):
        lm.ablate(torch.stack([d, 2 * d]))
    with pytest.raises(ValueError, match=r"row 0 is all zeros"):
        lm.clamp(torch.zeros(width), 0.0, 0.0)
    with pytest.raises(ValueError, match=r"directions steers blocks \[9\], but this model has blocks 0-3"):
        lm.ablate({9: d})
    with pytest.raises(ValueError, match=r"when must be one of .* got 'later'"):
        lm.ablate(d, when="later")
    with pytest.raises(ValueError, match=r"\(k0, k1\) with 0 <= k0 <= k1; got \(5, 2\)"):
        lm.ablate(d, when=(5, 2))


def test_an_opaque_block_is_its_output_and_holds_its_other_sites_inside_its_call():
    from kvwire.graph import site_calls

    hf = FAMILIES["llama"]()
    lm = kw.from_hf(hf, generic=True)  # blocks made of transformers' own modules: one call each
    calls = site_calls(lm.backbone, "block_out", [1])
    assert list(calls) == [1] and not calls[1].endswith("block_out")
    with pytest.raises(ValueError, match=r"site 'attn_out' of block 'layers.1' is inside the call 'layers.1'"):
        site_calls(lm.backbone, "attn_out", [1])  # edited inside the call (tests/test_steer_inner.py)
    d = _directions(lm.head.weight.shape[1], 1, 11)[0]
    want = hf_logits(hf, IDS, [(1, "block_out", lambda x: ref_ablate(x, d))])
    torch.testing.assert_close(lm.ablate(d, layers=[1])(IDS), want, atol=2e-4, rtol=2e-4)
