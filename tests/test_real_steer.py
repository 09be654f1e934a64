"""Steering the real default model: a vector trained on examples/data moves held-out words
monotonically with strength, and the steered cached generation equals its uncached rollout."""
import pytest
import torch

import kvwire as kw
from examples.steer_demo import effect, pairs

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def vec(default_lm):
    happy, sad = pairs()
    return kw.ControlVector.train(default_lm, happy, sad, layers="3-12", progress=False)


def test_effect_on_held_out_words_is_monotonic_in_strength(default_lm, vec):
    rows = effect(default_lm, vec, [-0.5, -0.25, 0.0, 0.25, 0.5])
    happy = [h for _, h, _ in rows]
    sad = [d for _, _, d in rows]
    gap = [h - d for _, h, d in rows]
    assert happy == sorted(happy) and sad == sorted(sad, reverse=True), rows
    assert gap == sorted(gap) and gap[-1] - gap[0] > 5.0, rows


def test_steered_greedy_through_the_cache_equals_uncached_rollout(default_lm, vec):
    steered = default_lm.steer(vec, 0.5)
    prompt = torch.tensor(default_lm.tokenizer.encode("My week has been"))
    got = steered.generate(prompt, max_new_tokens=12, ignore_eos=True).tolist()
    seq = prompt
    with torch.inference_mode():
        for _ in range(12):
            seq = torch.cat([seq, steered(seq[None])[0, -1].argmax()[None]])
    assert got == seq[len(prompt):].tolist()
    mixed = default_lm.steer(vec, torch.tensor([0.5, 0.0])).generate(["My week has been"] * 2, max_new_tokens=12)
    assert mixed == [default_lm.tokenizer.decode(got), default_lm.generate("My week has been", max_new_tokens=12)]
