"""State a token mixer keeps in attributes of its own modules, outside transformers' Cache API
(`kvwire.models.generic.held`): found by the build, kept in a state slot, the modules left as found.
What the slot must do on a real model (chunks, pads, the engine, the prefix store, transformers'
`generate`) is tested in `test_generic_state` on RecurrentGemma."""
import copy
import warnings

import pytest
import torch
from torch import nn

import kvwire as kw
from kvwire.generate.compiled import _compiled_graphs as _graphs  # graphs dynamo compiled so far
from kvwire.models.generic import held

from .generic_configs import PROMPT_IDS, cast_tokens_agree, tiny_model

transformers = pytest.importorskip("transformers")


class _Sum(nn.Module):
    def forward(self, x, use_cache=False):
        self.total = (self.total if self.total is not None else 0) + x.sum(1) if use_cache else None
        return x


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = nn.Sequential()
        self.mixer.add_module("inner", _Sum())
        self.mixer.inner.total = None
        self.mixer.kept = torch.ones(3)  # a tensor set at build time: not state
        self.mixer.inner.register_buffer("scale", torch.ones(2))  # a buffer: not state

    def forward(self, x, use_cache=False):
        self.mixer.last = x[:, -1] if use_cache else None
        return self.mixer.inner(x, use_cache)


def test_the_tensors_a_call_leaves_in_attributes_are_found_and_put_back():
    layer = _Layer()
    x = torch.randn(2, 5, 4)
    found = held.find(layer, lambda: layer(x, use_cache=True), batch_size=2)
    assert [(h.path, h.name, h.shape) for h in found] == [("mixer", "last", (4,)), ("mixer.inner", "total", (4,))]
    assert held.mixer_path(found) == "mixer"
    assert not hasattr(layer.mixer, "last") and layer.mixer.inner.total is None  # as found
    assert held.find(layer, lambda: layer(x), batch_size=2) == []  # without use_cache nothing is kept


def test_a_recurrent_gemma_layer_keeps_its_attributes_in_a_state_slot_and_leaves_them_as_found():
    original = tiny_model("recurrent_gemma")
    hf = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rerun warning: the layers keep their state
        lm = kw.from_hf(original, generic=True)
    assert lm.backbone.rerun_reason is None
    kinds = {type(part.states).__name__ for part in lm.backbone.layers if part.states is not None}
    assert kinds == {"HeldStates"}
    blocks = [m for m in original.modules() if type(m).__name__ == "RecurrentGemmaRecurrentBlock"]
    found = [(b.conv1d_state, b.rg_lru.recurrent_states) for b in blocks]  # what transformers' own calls left
    ids = torch.randint(*PROMPT_IDS, (2, 7), generator=torch.Generator().manual_seed(1))
    lm.generate(ids, max_new_tokens=5, ignore_eos=True)
    assert blocks and all(b.conv1d_state is c and b.rg_lru.recurrent_states is r for b, (c, r) in zip(blocks, found))
    with torch.no_grad():  # transformers' own forward, uncached, on the modules kvwire ran
        torch.testing.assert_close(original(ids, use_cache=False).logits, hf(ids, use_cache=False).logits)


@pytest.mark.parametrize("ahead", [True, False])
def test_compiled_steps_carry_state_kept_in_attributes(ahead):
    """`lm.compile()`: the exported step (ahead) or torch.compile (dynamo, whose graph breaks remake
    bound methods: the soft-capped head runs eager after the step's graph) steps the mixer as eager
    does. Under dynamo the decode step is one graph: the generic path hands its modules their per-call
    values in thread-locals dynamo traces (`generic.scoped`), where a ContextVar's `get` and `set`
    would each break the graph."""
    # two layers, one of each kind: each layer's kernels cost the compile seconds
    lm = kw.from_hf(tiny_model("recurrent_gemma", num_hidden_layers=2, block_types=["recurrent", "attention"]),
                    generic=True)
    assert not lm.head.plain and [part.states is not None for part in lm.backbone.layers] == [True, False]
    rows = [torch.tensor([3, 17, 42, 9, 55]), torch.tensor([7, 8])]
    eager = [t.tolist() for t in lm.generate(rows, max_new_tokens=8, ignore_eos=True)]
    torch._dynamo.reset()
    lm.compile(bucket=32, ahead=ahead, prefill_tokens=0)  # the steps: prompts run eager
    before = _graphs()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kvwire: the decode step cannot")  # it compiles, not eager
        assert [t.tolist() for t in lm.generate(rows, max_new_tokens=8, ignore_eos=True)] == eager
    if not ahead:
        assert _graphs() == before + 1  # the batch of two's decode step, whole


def test_a_model_cast_to_bfloat16_keeps_its_accumulator_in_float32():
    """The build tells the states that follow the model's dtype (the convolution's) from those kept in
    float32 whatever it is (the RG-LRU's accumulator) by a float64 probe: cast after the build, the
    model gives transformers' own bfloat16 tokens."""
    original = tiny_model("recurrent_gemma")
    hf = copy.deepcopy(original)
    lm = kw.from_hf(original, generic=True)
    held_states = lm.backbone.layers[0].states.states
    assert {h.name: h.follows for h in held_states} == {"conv1d_state": True, "recurrent_states": False}
    assert cast_tokens_agree(lm, hf, torch.bfloat16, (9, 5))
