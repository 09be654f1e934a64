"""Decoder layers that keep attention keys/values and recurrent state both (Falcon-H1's attention
beside its Mamba mixer, Zamba2's hybrid layers): the cache pass gives such a layer two slots, its
keys/values and its state. What the state must do (chunks, resets, pads, the engine, the prefix
store, transformers' `generate`) is tested with the other state slots in `test_generic_state`."""
import copy
import re

import pytest
import torch

import kvwire as kw
from kvwire.layers.base import Layer
from kvwire.models.generic import state as state_slots

from .generic_configs import prompt, tiny_model

transformers = pytest.importorskip("transformers")

L = 48


class TwoCaches(Layer):
    """A layer with two caches: a running sum of its inputs (B, 1, 1, D) and a count (B, 1, 1, 1),
    each a cache part of its own; it returns its input plus the running mean."""

    def __init__(self, width):
        super().__init__()
        self.width = width
        self.sums, self.counts = _Part((1, 1, width)), _Part((1, 1, 1))

    @property
    def cache_parts(self):
        return {"sum": self.sums, "count": self.counts}

    def cache_spec(self, batch_size, max_length, dtype):
        return None  # the parts give the shapes

    def forward(self, x):
        return x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]

    def forward_cached(self, x, *, positions, cache_index, attention_mask, cache):
        (s, s2), (n, n2) = cache
        sums = s[:, 0, 0, None] + x.cumsum(1)  # (B, T, D)
        counts = n[:, 0, 0, None] + torch.arange(1, x.shape[1] + 1)[:, None]  # (B, T, 1)
        return x + sums / counts, ((sums[:, -1, None, None], s2), (counts[:, -1, None, None], n2))


class _Part(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def cache_spec(self, batch_size, max_length, dtype):
        return (batch_size, *self.shape), (batch_size, *self.shape)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.mix = TwoCaches(4)

    def forward(self, ids):
        return self.mix(self.embed(ids))


def test_a_layer_with_cache_parts_gets_one_slot_per_part():
    toy = Toy()
    cached = kw.with_cache(toy)
    assert cached.names == ["mix.sum", "mix.count"]
    cache = cached.init_cache(2, 8)
    assert [tuple(k.shape) for k, _ in cache] == [(2, 1, 1, 4), (2, 1, 1, 1)]
    ids = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        first, cache = cached(ids[:, :4], torch.arange(4)[None].expand(2, 4), 0, mask, cache)
        rest, cache = cached(ids[:, 4:], torch.arange(4, 7)[None].expand(2, 3), 4, mask, cache)
        torch.testing.assert_close(torch.cat([first, rest], 1), toy(ids))  # both parts carried across calls
    assert cache[1][0].flatten().tolist() == [7.0, 7.0]


@pytest.fixture(scope="module")
def falcon():
    return kw.from_hf(tiny_model("falcon_h1"), generic=True)


def test_a_hybrid_layer_holds_its_keys_values_and_a_fixed_state(falcon):
    cached = falcon.cached
    layers = len(falcon.backbone.layers)
    assert cached.names == [f"layers.{i}.{part}" for i in range(layers) for part in ("attention", "state")]
    short, long = cached.init_cache(2, 16), cached.init_cache(2, 64)
    for k, name in enumerate(cached.names):
        if name.endswith(".attention"):  # keys/values along the timeline
            assert short[k][0].shape[2] == 16 and long[k][0].shape[2] == 64
        else:  # a ring of one slot, whatever the timeline
            assert [t.shape for t in short[k]] == [t.shape for t in long[k]]
            assert short[k][0].shape[:3] == (2, 1, 1)


def test_a_hybrid_prompt_prefilled_in_chunks_leaves_the_keys_values_of_one_call(falcon):
    ids = prompt(1, 13, seed=1)
    mask = torch.ones(1, L, dtype=torch.bool)
    cached = falcon.cached

    def run(chunks):
        cache, at = cached.init_cache(1, L), 0
        with torch.no_grad():
            for chunk in chunks:
                t = chunk.shape[1]
                _, cache = cached(chunk, torch.arange(at, at + t)[None], at, mask, cache)
                at += t
        return cache

    whole, chunked = run([ids]), run([ids[:, :5], ids[:, 5:6], ids[:, 6:]])
    for name, a, b in zip(cached.names, whole, chunked):
        if name.endswith(".attention"):
            assert a[0][:, :, 13:].abs().max() == 0  # nothing written past the prompt
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-4 * max(1.0, x.abs().max().item()), rtol=1e-4)


def test_a_hybrid_layer_whose_mixer_takes_no_padding_mask_reruns_saying_why(monkeypatch):
    """A hybrid layer's state slot needs its mixer to take the padding mask: without one the slot is
    refused saying so, and the layers rerun over their kept inputs, left-padded rows still alone."""
    monkeypatch.setattr(state_slots, "mixer_takes_mask", lambda mixer: False)
    with pytest.warns(UserWarning, match="rerun"):
        lm = kw.from_hf(copy.deepcopy(tiny_model("falcon_h1")), generic=True)
    assert re.search(r"FalconH1ForCausalLM: decoder layer 0 \(FalconH1DecoderLayer\) keeps attention keys/values "
                     r"and recurrent state \(conv, recurrent\), but the mixer keeping the state \(FalconH1Mixer\) "
                     r"takes no `attention_mask`", lm.backbone.rerun_reason)
    rows = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9)]
    batch = lm.generate(rows, max_new_tokens=6, ignore_eos=True)
    for i, row in enumerate(rows):
        assert batch[i].tolist() == lm.generate(row, max_new_tokens=6, ignore_eos=True).tolist(), i
