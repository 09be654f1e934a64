"""Steering on edited and stacked models: block numbers survive edits, stacked vectors keep their
strengths, per-row strengths fit their batch, inserted plain modules speak the cache protocol."""
import pytest
import torch
from torch import nn

import kvwire as kw

from .conftest import FAMILIES
from .test_guards import _rollout
from .test_steer import _random_vector
from .test_steer import chat as lm  # noqa: F401  (a fixture: tiny model of each family, char tokenizer)

IDS = torch.tensor([[3, 17, 42, 9, 55, 23]])


def _vector(lm, layers, seed=0):
    return _random_vector(lm, layers, scale=2.0, seed=seed)


def test_stacked_vectors_keep_their_own_strengths(lm):
    v1, v2 = _vector(lm, [1], seed=1), _vector(lm, [2], seed=2)
    both = lm.steer(v1, 0.5).steer(v2, 2.0)
    assert sorted(both.cached.runtime_inputs) == ["steer2_end", "steer2_start", "steer2_strength", "steer_end", "steer_start", "steer_strength"]
    got = both.generate(IDS, max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    assert got.tokens[0] == _rollout(both, IDS, 6)  # cached (v2 at 2.0) == uncached (v2 at 2.0)
    # the same as putting both in by hand, each at its strength
    by_hand = lm.edit(kw.insert_after("*.1", kw.Steer(v1.directions[1], 0.5)))
    by_hand = by_hand.edit(kw.insert_after("*.2", kw.Steer(v2.directions[2], 2.0, name="other")))
    torch.testing.assert_close(both(IDS), by_hand(IDS))
    assert got.tokens[0] == by_hand.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist()


def test_an_explicit_shared_name_must_agree(lm):
    v1, v2 = _vector(lm, [1], seed=1), _vector(lm, [2], seed=2)
    shared = lm.steer(v1, 0.5).steer(v2, 0.5, name="steer")  # same strength: one input, fine
    assert sorted(shared.cached.runtime_inputs) == ["steer_end", "steer_start", "steer_strength"]
    with pytest.raises(ValueError, match=r"already has runtime inputs named 'steer' \(width=\d+, strength=0.5, "
                                         r"when='all', name='steer'\); layers sharing a name share their inputs"):
        lm.steer(v1, 0.5).steer(v2, 2.0, name="steer")


def test_two_defaults_for_one_runtime_input_are_refused(lm):
    v = _vector(lm, [1, 2])
    edited = lm.edit(kw.insert_after("*.1", kw.Steer(v.directions[1], 0.5)))
    edited = edited.edit(kw.insert_after("*.2", kw.Steer(v.directions[2], 2.0)))
    with pytest.raises(ValueError, match=r"share runtime input 'steer_strength' but default it to \[0.5\] and \[2.0\]"):
        edited.generate(IDS, max_new_tokens=2)


def test_block_numbers_survive_a_skip(lm):
    stem = kw.block_calls(lm.backbone)[0].rsplit(".", 1)[0]
    skipped = lm.edit(kw.skip(f"{stem}.1"))
    assert kw.graph.numbered_blocks(skipped.backbone) == {0: f"{stem}.0", 2: f"{stem}.2"} | (
        {3: f"{stem}.3"} if len(kw.block_calls(lm.backbone)) > 3 else {})
    v = _vector(lm, [2])
    steered = skipped.steer(v, 1.0)
    inserted = [n for n in steered.backbone.meta["kvwire_inserted"]]
    assert inserted == [f"{stem}_2__Steer"]  # after block 2 itself, not after the second remaining block
    by_hand = skipped.edit(kw.insert_after(f"{stem}.2", kw.Steer(v.directions[2], 1.0)))
    torch.testing.assert_close(steered(IDS), by_hand(IDS))
    with pytest.raises(ValueError, match=r"control vector steers blocks \[1\], but this model has blocks 0, 2"):
        skipped.steer(_vector(lm, [1]), 1.0)
    with pytest.raises(ValueError, match=rf"selector '{stem}.1' matches no layer call; the calls are: .*{stem}.0, "
                                         rf"{stem}.2"):
        skipped.edit(kw.skip(f"{stem}.1"))


def test_training_on_a_skipped_model_numbers_blocks_by_their_own_index(lm):
    stem = kw.block_calls(lm.backbone)[0].rsplit(".", 1)[0]
    skipped = lm.edit(kw.skip(f"{stem}.1"))
    pos, neg = ["I love it", "So glad", "Great"], ["I hate it", "So sad", "Awful"]
    vec = kw.ControlVector.train(skipped, pos, neg, progress=False)
    assert 1 not in vec.layers and 2 in vec.layers
    one = kw.ControlVector.train(skipped, pos, neg, layers=[2], progress=False)
    # block 2's direction read after block 2 of the skipped model, whatever the position
    tapped = kw.ControlVector.train(skipped, pos, neg, layers="2-2", progress=False)
    torch.testing.assert_close(one.directions[2], tapped.directions[2])
    torch.testing.assert_close(vec.directions[2], one.directions[2])
    with pytest.raises(ValueError, match=r"layer indices \[1\] are not blocks of this model: it has blocks 0, 2"):
        kw.ControlVector.train(skipped, pos, neg, layers=[1], progress=False)


def test_degenerate_training_data_is_refused(lm):
    with pytest.raises(ValueError, match=r"cannot train a pca_diff direction at block 1: the pairs' differences are "
                                         r"all equal \(one pair, or identical pairs\)"):
        kw.ControlVector.train(lm, ["I love it"], ["I hate it"], layers=[1], method="pca_diff", progress=False)
    with pytest.raises(ValueError, match="cannot train a pca_diff direction"):
        kw.ControlVector.train(lm, ["I love it"] * 3, ["I hate it"] * 3, layers=[1], method="pca_diff", progress=False)
    with pytest.raises(ValueError, match="cannot train a pca_center direction at block 1: positive and negative "
                                         "prompts give the same hidden states"):
        kw.ControlVector.train(lm, ["same", "text"], ["same", "text"], layers=[1], progress=False)
    one = kw.ControlVector.train(lm, ["I love it"], ["I hate it"], layers=[1], method="mean_diff", progress=False)
    assert (one.directions[1] != 0).sum() > 1


def test_training_checks_the_context(lm):
    long = "x" * (lm.max_context + 5)
    with pytest.raises(ValueError, match=r"prompt 'xxxx.* has 134 tokens, more than the model's context of 128"):
        kw.ControlVector.train(lm, [long, "a"], ["b", "c"], layers=[1], progress=False)


def test_per_row_strengths_fit_their_batch_only(lm):
    mixed = lm.steer(_vector(lm, [1]), torch.tensor([1.0, 0.0]))
    assert mixed(IDS.repeat(2, 1)).shape[0] == 2
    with pytest.raises(ValueError, match=r"steering strength has 2 rows \(one per prompt\) but the batch has 1"):
        mixed(IDS)
    with pytest.raises(ValueError, match="steering strength has 2 rows"):
        mixed.score("Some text")
    with pytest.raises(ValueError, match="steering strength has 2 rows but the batch has 3"):
        mixed.generate(["a", "b", "c"], max_new_tokens=2)
    one = lm.steer(_vector(lm, [1]), torch.tensor([1.5]))  # a (1,) strength fits any batch, cached or not
    assert one(IDS.repeat(2, 1)).shape[0] == 2
    torch.testing.assert_close(one(IDS.repeat(2, 1)), lm.steer(_vector(lm, [1]), 1.5)(IDS.repeat(2, 1)))


class PlainShift(nn.Module):
    """Not a kvwire Layer: a plain module asking for positions (adds a vector from position 3 on)."""

    uses_positions = True

    def __init__(self, width):
        super().__init__()
        self.register_buffer("v", torch.linspace(-2, 2, width))

    def forward(self, x):
        return self.forward_cached(x, positions=torch.arange(x.shape[1])[None])

    def forward_cached(self, x, *, positions):
        return x + (positions >= 3).to(x.dtype)[..., None] * self.v


def test_a_plain_module_speaking_the_protocol_is_called_as_a_layer(lm):
    edited = lm.edit(kw.insert_after("*.1", PlainShift(lm.head.weight.shape[1])))
    full = edited(IDS)
    got = edited.generate(IDS, max_new_tokens=5, ignore_eos=True, return_logprobs=True)
    assert got.tokens[0] == _rollout(edited, IDS, 5)
    cache = edited.cached.init_cache(1, 16)
    mask = torch.ones(1, 16, dtype=torch.bool)
    hidden, _ = edited.cached(IDS, torch.arange(6)[None], 0, mask, cache)
    torch.testing.assert_close(edited.head(hidden), full, rtol=1e-5, atol=1e-5)


class NoCachedForward(nn.Module):
    runtime_inputs = {"gain": torch.float32}

    def forward(self, x):
        return x


def test_a_plain_module_without_forward_cached_is_refused(lm):
    with pytest.raises(TypeError, match="NoCachedForward sets runtime_inputs but has no forward_cached or "
                                        "runtime_defaults"):
        lm.edit(kw.insert_after("*.1", NoCachedForward()))


def test_a_model_with_every_block_skipped_has_none_to_steer():
    lm = kw.from_hf(FAMILIES["gpt2"](n_layer=1))
    empty = lm.edit(kw.skip("h.0"))
    assert kw.graph.numbered_blocks(empty.backbone) == {}
    with pytest.raises(ValueError, match=r"control vector steers blocks \[0\], but this model has blocks none"):
        empty.steer(kw.ControlVector({0: torch.randn(lm.head.weight.shape[1])}))


def test_a_second_vector_acts_at_every_call_of_a_block_called_twice(lm):
    """A block an edit calls again (here block 1 after block 2) is steered after each of its calls,
    by the first vector and by the one stacked on it: as hooks on the block give uncached."""
    stem = kw.block_calls(lm.backbone)[0].rsplit(".", 1)[0]
    again = lm.edit(kw.insert_after(f"{stem}.2", lm.backbone.get_submodule(f"{stem}.1")))
    v1, v2 = _vector(again, [1], seed=1), _vector(again, [1], seed=2)
    both = again.steer(v1, 0.5).steer(v2, -1.5)
    steers = [n for n, m in both.backbone.named_modules() if isinstance(m, kw.Steer)]
    assert len(steers) == 4, steers  # two vectors after each of the two calls
    got = both(IDS)
    generated = both.generate(IDS, max_new_tokens=4, ignore_eos=True, return_logprobs=True).tokens[0]
    shift = 0.5 * v1.directions[1] - 1.5 * v2.directions[1]
    hook = again.backbone.get_submodule(f"{stem}.1").register_forward_hook(lambda m, a, out: out + shift)
    try:  # (the steered model shares the block: hooked only now)
        torch.testing.assert_close(got, again(IDS))
        assert generated == _rollout(again, IDS, 4)
    finally:
        hook.remove()
