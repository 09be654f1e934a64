"""State a mixer keeps in a cache class of the model's own (`kvwire.models.generic.owned`), on toy
classes: what the probe finds, what it refuses, and the slot's round trip through a fresh object.
MiniMax, the transformers model that keeps its state so, runs in tests/test_generic_state.py."""
import pytest
import torch

from kvwire.models.generic import owned
from kvwire.models.generic.state import spec

from .generic_configs import tiny_model

pytest.importorskip("transformers")


class Store:
    """A model's own cache object: lists its layers' states by index, as MiniMax's does."""

    def __init__(self):
        self.kept = []
        self.seen = 0


class NeedsConfig(Store):
    def __init__(self, config):
        super().__init__()
        self.config = config


def _keeps(states):
    """call(cache): a layer's probe call that leaves `states` at index 1 of `cache.kept`."""
    def call(cache):
        cache.kept = [[], *states]
        cache.seen += 1
    return call


def test_the_tensors_a_call_leaves_are_its_states_and_the_rest_is_kept_as_laid_out():
    found, layouts = owned.find(Store, _keeps([torch.ones(2, 3, 4), torch.zeros(2, 5)]), batch_size=2)
    assert [(s.name, s.leaf, s.shape) for s in found] == [("kept", 0, (3, 4)), ("kept", 1, (5,))]
    assert set(layouts) == {"kept"}  # `seen` holds no tensor


def test_a_call_leaving_nothing_finds_nothing_and_a_stray_tensor_is_refused():
    assert owned.find(Store, lambda cache: None, batch_size=2) == ([], {})
    with pytest.raises(ValueError, match=r"`kept` that are not states of the batch's rows .*\(3,\)"):
        owned.find(Store, _keeps([torch.ones(2, 4), torch.ones(3)]), batch_size=2)


def test_the_slot_goes_in_through_a_fresh_object_and_comes_back():
    found, layouts = owned.find(Store, _keeps([torch.ones(2, 3, 4), torch.zeros(2, 5)]), batch_size=2)
    states = owned.OwnedStates(found, layouts, Store)
    conv, recurrent = (torch.zeros(s) for s in spec(found, 2))
    recurrent.copy_(torch.arange(2 * 17, dtype=torch.float32).view(recurrent.shape))
    keep = torch.tensor([1.0, 0.0])  # the second row starts afresh
    cache = states.open((conv, recurrent), keep)
    assert cache.kept[0] == [] and cache.seen == 0  # a fresh object, laid out as the probe left it
    first, second = cache.kept[1], cache.kept[2]
    assert torch.equal(first[0].flatten(), torch.arange(12.0)) and torch.equal(second[0], torch.arange(12.0, 17.0))
    assert first[1].abs().sum() == 0 and second[1].abs().sum() == 0  # scaled by keep
    cache.kept[2] = second + 100  # what the layer leaves
    slot = states.close(cache, (conv, recurrent))
    assert slot[1] is recurrent  # written in place in eager calls
    assert torch.equal(recurrent.view(2, 17)[:, 12:], torch.stack([torch.arange(112.0, 117.0), torch.full((5,), 100.0)]))


def test_every_row_starting_afresh_gets_an_empty_object():
    found, layouts = owned.find(Store, _keeps([torch.ones(2, 3)]), batch_size=2)
    states = owned.OwnedStates(found, layouts, Store)
    pair = tuple(torch.ones(s) for s in spec(found, 2))
    assert states.open(pair, torch.zeros(2)).kept == []  # the mixer's own call without a state
    assert len(states.open(pair, torch.tensor([0.0, 1.0])).kept) == 2


def test_a_class_needing_its_config_is_made_with_it_once_decided():
    make = owned.maker(NeedsConfig, config="the config")
    assert make().config == "the config"
    assert owned.maker(Store, config="unused") is Store


def test_a_model_with_transformers_own_cache_has_no_class_of_its_own():
    model = tiny_model("llama")
    cls, why = owned.own_class(model.model, torch.tensor([[5, 6, 7]]), "cache")
    assert cls is None and "no cache class of its own" in why
    cls, why = owned.own_class(model.model, torch.tensor([[5, 6, 7]]), None)
    assert cls is None and "takes no cache" in why


def test_minimax_keeps_its_linear_caches_in_its_own_class():
    model = tiny_model("minimax")
    cls, why = owned.own_class(model.model, torch.tensor([[5, 6, 7]]), "cache")
    assert why is None and cls.__name__ == "MiniMaxCache"
