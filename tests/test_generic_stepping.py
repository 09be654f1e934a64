"""Mixers whose call of several tokens ignores the state they are handed (transformers' Mamba-1
scan) continue a state one token at a time (`kvwire.models.generic.stepping`). What the state
must then do on real models (chunks, pads, the engine, the prefix store, transformers' `generate`)
is tested in `test_generic_state` on Mamba and FalconMamba."""
import copy
import inspect
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import kvwire as kw
from kvwire.models.generic import stepping

from .generic_configs import greedy_disagreements, hf_logits, prompt, tiny_model


class ForgetfulSum(nn.Module):
    """A running sum of its (unpadded) inputs kept in `cache.state` (B, D) that, like transformers'
    Mamba-1 scan, continues the state only when called with one token."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, hidden_states, cache=None, attention_mask=None):
        self.calls.append(hidden_states.shape[1])
        x = hidden_states * attention_mask[..., None]
        start = cache.state if x.shape[1] == 1 else torch.zeros_like(cache.state)
        sums = start[:, None] + x.cumsum(1)  # (B, T, D)
        cache.state = sums[:, -1]
        return sums


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, generator=g)
    mask = torch.ones(2, 5)
    mask[1, :2] = 0  # left pads
    return x, mask, torch.randn(2, 3, generator=g)


def test_a_marked_cache_makes_the_mixer_go_one_token_at_a_time():
    x, mask, state = _inputs()
    mixer = ForgetfulSum()
    stepping.install(mixer)
    stepping.install(mixer)  # once
    cache = SimpleNamespace(state=state.clone(), **{stepping.MARK: True})
    out = mixer(x, cache=cache, attention_mask=mask)
    assert mixer.calls == [1] * 5
    expected = state[:, None] + (x * mask[..., None]).cumsum(1)  # continuing the state, pads left out
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cache.state, expected[:, -1])


def test_an_unmarked_cache_keeps_the_mixers_own_call_and_signature():
    x, mask, state = _inputs()
    mixer = ForgetfulSum()
    stepping.install(mixer)
    out = mixer(x, SimpleNamespace(state=state.clone()), mask)
    assert mixer.calls == [5]
    torch.testing.assert_close(out, (x * mask[..., None]).cumsum(1))
    assert list(inspect.signature(mixer.forward).parameters) == ["hidden_states", "cache", "attention_mask"]


def test_a_chunk_steps_when_a_row_continues_a_state():
    assert not stepping.continues(torch.tensor([1.0, 1.0]), 6)  # every row starts afresh: the fast scan
    assert stepping.continues(torch.tensor([1.0, 0.0]), 6)  # one row continues: every row steps
    assert not stepping.continues(torch.tensor([0.0, 0.0]), 1)  # the mixer's own one-token step


def test_a_model_whose_chunks_stay_wrong_token_by_token_reruns_saying_why(monkeypatch):
    """Without its one-token steps Mamba's chunked prefill stays wrong: its state slot is refused
    saying so, and its layers rerun over their kept inputs instead, still equal to transformers'."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(stepping, "install", lambda mixer: None)
    hf = tiny_model("mamba")
    with pytest.warns(UserWarning, match="rerun"):
        lm = kw.from_hf(copy.deepcopy(hf), generic=True)
    assert re.match(r"^MambaForCausalLM: a prompt prefilled in chunks does not reproduce the model's own logits "
                    r"\(first at position 6 of a 12-token probe prefilled in calls of 6 and 6 tokens, also with its "
                    r"state-keeping mixers continuing one token at a time\); its layers do not carry their state "
                    r"across calls of several tokens, and kvwire prefills prompts in chunks$", lm.backbone.rerun_reason)
    ids = prompt(2, 9, seed=3)
    tokens = torch.stack(lm.generate(ids, max_new_tokens=8, ignore_eos=True))
    assert greedy_disagreements(lambda x: hf_logits(hf, x), ids, tokens) == []
