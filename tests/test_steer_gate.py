"""Conditional steering: a probe at one site gates an operation at another == the same written with
transformers hooks; hard and smooth gates; per-row thresholds; cached == uncached; bad input."""
import pytest
import torch

import kvwire as kw
from kvwire.steer.gate import Gate, GatedInsert, Probe
from kvwire.steer.ops import Ablate

from .conftest import FAMILIES
from .test_guards import _rollout
from .test_steer_ops import IDS, hook_site, ref_ablate


def _gated(lm, w, d, threshold=0.0, sharpness=None, probe_site="block_out", target=(2, "mlp_out")):
    probe = Gate(w, layer=1, site=probe_site, threshold=threshold, sharpness=sharpness).probe()
    call = f"layers.{target[0]}.{target[1]}"
    return lm.edit(GatedInsert(f"layers.1.{probe_site}", probe, {call: Ablate(d)}), depth="layer")


def _reference(hf, ids, w, d, threshold, sharpness=None):
    """Hooks: read the probe at block 1's output, ablate d from block 2's MLP write where it is open."""
    seen = {}

    def read(x):
        score = x.double() @ w.double()
        margin = (score - threshold)[..., None]
        seen["gate"] = (margin > 0).double() if sharpness is None else torch.sigmoid(sharpness * margin)
        return x

    def gated(x):
        return (x.double() + seen["gate"] * (ref_ablate(x, d).double() - x.double())).to(x.dtype)

    handles = hook_site(hf, 1, "block_out", read) + hook_site(hf, 2, "mlp_out", gated)
    try:
        with torch.no_grad():
            return hf(ids).logits, seen["gate"]
    finally:
        for h in handles:
            h.remove()


def _probe_and_direction(lm, seed):
    """(probe w, direction d, threshold): the threshold halfway between the two middle scores of w
    at block 1's output on IDS: open at some positions, shut at others, and no position on the edge
    (where float32 and float64 could disagree)."""
    g = torch.Generator().manual_seed(seed)
    w, d = torch.randn(32, generator=g), torch.randn(32, generator=g)
    with torch.no_grad():
        s = (kw.tap(lm.backbone, "layers.1")(IDS)[1]["layers.1"][0] @ w).sort().values
    k = len(s) // 2
    return w, d, float((s[k - 1] + s[k]) / 2)


@pytest.fixture(scope="module")
def pair():
    hf = FAMILIES["llama"]()
    return hf, kw.from_hf(hf)


@pytest.mark.parametrize("sharpness", [None, 4.0])
def test_a_gated_operation_matches_transformers_hooks(pair, sharpness):
    hf, lm = pair
    w, d, threshold = _probe_and_direction(lm, seed=0)
    want, gate = _reference(hf, IDS, w, d, threshold, sharpness)
    if sharpness is None:
        assert 0 < gate.sum() < gate.numel()
    torch.testing.assert_close(_gated(lm, w, d, threshold, sharpness)(IDS), want, atol=2e-4, rtol=2e-4)


def test_per_row_thresholds_and_cached_decoding(pair):
    _, lm = pair
    g = torch.Generator().manual_seed(1)
    w, d = torch.randn(32, generator=g), torch.randn(32, generator=g) * 3
    model = _gated(lm, w, d)
    assert model.generate(IDS, max_new_tokens=8, ignore_eos=True)[0].tolist() == _rollout(model, IDS, 8)
    shut, open_ = torch.tensor([1e9]), torch.tensor([-1e9])
    rows = model.generate(IDS.expand(2, -1), max_new_tokens=6, ignore_eos=True,
                          inputs={"gate_threshold": torch.cat([shut, open_])})
    assert rows[0].tolist() == lm.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist()
    always = lm.ablate(d, layers=[2], site="mlp_out")
    assert rows[1].tolist() == always.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist()


def test_a_probe_after_what_it_gates_is_refused(pair):
    _, lm = pair
    probe = Probe(torch.randn(32))
    with pytest.raises(ValueError, match=r"probe at 'layers.2.block_out' comes after the gated operation at "
                                         r"'layers.1.mlp_out'"):
        lm.edit(GatedInsert("layers.2.block_out", probe, {"layers.1.mlp_out": Ablate(torch.randn(32))}), depth="layer")


def test_bad_probes_are_refused():
    with pytest.raises(ValueError, match="probe kind must be one of"):
        Probe(torch.randn(8), kind="angle")
    with pytest.raises(ValueError, match="sharpness must be a positive number"):
        Probe(torch.randn(8), sharpness=0)
    with pytest.raises(ValueError, match="probe direction is all zeros"):
        Probe(torch.zeros(8))
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        Probe(torch.randn(8), threshold=float("nan"))


def test_the_gate_keyword_of_steer_ablate_and_clamp(pair):
    hf, lm = pair
    w, d, threshold = _probe_and_direction(lm, seed=2)
    gate = kw.Gate(w, layer=1, threshold=threshold)
    model = lm.ablate(d, layers=[2], site="mlp_out", gate=gate)
    want, _ = _reference(hf, IDS, w, d, threshold)
    torch.testing.assert_close(model(IDS), want, atol=2e-4, rtol=2e-4)
    assert model.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist() == _rollout(model, IDS, 6)
    both = model.steer(kw.ControlVector({3: d}), 2.0, gate=kw.Gate(w, layer=2, name="gate2"))
    assert {"gate_threshold", "gate2_threshold"} <= set(both.cached.runtime_inputs)
    with pytest.raises(ValueError, match="already has a gate named 'gate' with threshold"):
        model.clamp(d, 0.0, 0.0, layers=[3], gate=kw.Gate(w, layer=2, threshold=threshold + 1))
    with pytest.raises(ValueError, match="comes after the gated operation"):
        lm.ablate(d, layers=[1], gate=kw.Gate(w, layer=2))
