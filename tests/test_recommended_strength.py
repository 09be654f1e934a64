"""A control vector's recommended strength (`ControlVector.strength`): saved in its file, applied by
`lm.steer`, `lm.ablate` and `lm.clamp` when they are given none, overridden by one given."""
import pytest
import torch

import kvwire as kw

from .conftest import FAMILIES


@pytest.fixture(scope="module")
def lm():
    return kw.from_hf(FAMILIES["llama"]())


def vector(operation="add", strength=None):
    g = torch.Generator().manual_seed(1)
    return kw.ControlVector({i: torch.randn(32, generator=g) * 3 for i in (1, 2)}, operation=operation,
                            strength=strength)


def logits(lm, prompt=(3, 17, 42, 9, 55)):
    return lm.generate(torch.tensor(prompt), max_new_tokens=4, ignore_eos=True, return_logprobs=True).logprobs[0]


def test_the_file_keeps_it_and_arithmetic_drops_it(tmp_path):
    vec = vector("clamp", -1.25)
    vec.save(tmp_path / "v.gguf")
    assert kw.ControlVector.load(tmp_path / "v.gguf").strength == -1.25
    vector().save(tmp_path / "plain.gguf")
    assert kw.ControlVector.load(tmp_path / "plain.gguf").strength is None  # absent: none recommended
    assert (vec * 2).strength is None and (-vec).strength is None
    assert vec == vector("clamp")  # like `method`, not part of what the vector is


def test_steer_ablate_and_clamp_apply_it_when_given_none(lm):
    for op, apply, given in [("add", lambda v, s=None: lm.steer(v, s), 2.5),
                             ("ablate", lambda v, s=None: lm.ablate(v, strength=s), 0.5)]:
        recommended = vector(op, given)
        assert logits(apply(recommended)) == logits(apply(vector(op), given)), op
        assert logits(apply(recommended, 1.0)) == logits(apply(vector(op))), op  # a strength given wins
        assert logits(apply(recommended)) != logits(apply(vector(op))), op  # the test can tell
    held = vector("clamp", -1.5)
    assert logits(lm.clamp(held)) == logits(lm.clamp(vector("clamp"), -1.5, -1.5))
    # bounds given win; to the last bit of float32, not bit for bit: after the calls above, an AVX2-only
    # CPU's float32 kernels give one of these logits 1 ulp apart (each is exact when run alone)
    torch.testing.assert_close(logits(lm.clamp(held, hi=3.0)), logits(lm.clamp(vector("clamp"), hi=3.0)),
                               rtol=4e-7, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "2", True])
def test_a_strength_that_is_not_a_finite_number_is_refused(bad):
    with pytest.raises(ValueError, match=r"strength must be a finite number or None \(the recommended strength\), "
                                         r"got"):
        vector(strength=bad)


def test_a_server_keeps_a_clamp_vector_inert_until_a_request_bounds_it(lm):
    """The server builds named clamp vectors unbounded by default: a file's recommended value must not
    clamp requests that never name the vector."""
    from kvwire.serve.options import steered_model

    served = steered_model(lm, {"calm": vector("clamp", -1.5)})
    assert logits(served) == logits(lm)
    bounded = {"calm_lo": torch.tensor([-1.5]), "calm_hi": torch.tensor([-1.5])}
    got = served.generate(torch.tensor((3, 17, 42, 9, 55)), max_new_tokens=4, ignore_eos=True, return_logprobs=True,
                          inputs=bounded).logprobs[0]
    assert got == logits(lm.clamp(vector("clamp"), -1.5, -1.5))
