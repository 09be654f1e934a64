"""What `kvwire.models.generic.handed` finds in a decoder layer handed its state as an argument by
its model's forward, on toy models: the state argument, the part of a tensor shared by every layer
that a layer owns, the initial values, where the new state comes back, and what it refuses."""
import torch
from torch import nn

from kvwire.models.generic import handed

B, T, D, L = 2, 5, 6, 3


class _ColumnBlock(nn.Module):
    """A running maximum kept in column `index` of every all-layer state tensor, written in place (as
    RWKV's blocks do); its one-token call compares a (B, D) state with (B, 1, D) features when
    `broadcasts` (a (B, B, D) result for B > 1)."""

    def __init__(self, index, broadcasts=False):
        super().__init__()
        self.index, self.broadcasts = index, broadcasts
        self.mix = nn.Linear(D, D)

    def forward(self, hidden, state=None, use_cache=False):
        features = self.mix(hidden)
        if state is None:
            return hidden + features.cummax(1).values, None
        previous = state[0][:, :, self.index]  # (B, D)
        if hidden.shape[1] == 1 and self.broadcasts:
            running = torch.maximum(previous, features)
        else:
            running = torch.maximum(previous[:, None], features.cummax(1).values)
        state[0][:, :, self.index] = running[:, -1]
        return hidden + running, state


class _TupleBlock(nn.Module):
    """Returns a new (sum, count) state tuple (as xLSTM's blocks do)."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, hidden, state=None):
        B = hidden.shape[0]
        total, count = state if state is not None else (torch.zeros(B, D), torch.zeros(B, 1))
        total = total + self.mix(hidden).sum(1)
        count = count + hidden.shape[1]
        return hidden + total[:, None] / count[:, None], (total, count)


class _Base(nn.Module):
    """A base model whose forward makes the state with use_cache=True: `make(B)` -> (state for layer i)."""

    def __init__(self, blocks, make, shared=True):
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.blocks = nn.ModuleList(blocks)
        self.make, self.shared = make, shared

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, inputs_embeds=None, use_cache=False):
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        state = self.make(hidden) if use_cache else None
        for i, block in enumerate(self.blocks):
            handed_state = state if self.shared or state is None else state[i]
            hidden, new = block(hidden, handed_state)
        return hidden


def _find(base):
    torch.manual_seed(0)
    probe = torch.randint(0, 50, (B, T))
    layers = dict(enumerate(base.blocks))
    recorded = {i: (torch.randn(B, T, D), (None,), {}) for i in layers}  # the uncached call: no state
    return handed.find(base, probe, layers, recorded)


def _shared_state(hidden):
    return [torch.full((hidden.shape[0], D, L), -5.0, dtype=hidden.dtype)]


def test_a_layer_writing_its_column_of_a_shared_tensor_owns_that_column_from_its_initial_value():
    torch.manual_seed(0)
    found = _find(_Base([_ColumnBlock(i) for i in range(L)], _shared_state))
    for i, states in found.items():
        assert isinstance(states, handed.HandedStates), states
        (h,) = states.states
        assert (h.leaf, h.axis, h.index, h.shape) == (0, 2, i, (D,))
        assert states.initial == [-5.0]  # the forward's initial value, not zeros
        assert states.returned == 1 and states.use_cache  # it takes use_cache: handed True
        assert h.follows  # the forward makes it in the input embeddings' dtype
        assert not states.rows_apart


def test_a_returned_tuple_is_the_new_state_and_each_tensor_a_whole_state():
    torch.manual_seed(0)
    make = lambda hidden: [(torch.zeros(hidden.shape[0], D), torch.zeros(hidden.shape[0], 1)) for _ in range(2)]
    found = _find(_Base([_TupleBlock(), _TupleBlock()], make, shared=False))
    for states in found.values():
        assert [(h.leaf, h.axis, h.shape, h.dtype) for h in states.states] == [(0, None, (D,), torch.float32),
                                                                               (1, None, (1,), torch.float32)]
        assert states.returned == 1 and states.initial == [0.0, 0.0]
        assert not any(h.follows for h in states.states)  # made float32 whatever the embeddings' dtype


def test_a_one_token_call_that_mixes_rows_is_found():
    torch.manual_seed(0)
    found = _find(_Base([_ColumnBlock(i, broadcasts=i == 1) for i in range(L)], _shared_state))
    assert [found[i].rows_apart for i in range(L)] == [False, True, False]


def test_refused_with_the_reason():
    torch.manual_seed(0)
    rows_differ = lambda hidden: [torch.arange(hidden.shape[0], dtype=hidden.dtype).view(-1, 1, 1).expand(-1, D, L)
                                  .clone()]
    found = _find(_Base([_ColumnBlock(i) for i in range(L)], rows_differ))
    assert "initial state `state` differs between rows" in found[0]

    class Failing(_Base):
        def forward(self, input_ids=None, inputs_embeds=None, use_cache=False):
            if use_cache:
                raise RuntimeError("no cache here")
            return super().forward(input_ids, inputs_embeds)

    found = _find(Failing([_ColumnBlock(i) for i in range(L)], _shared_state))
    assert "with use_cache=True fails (RuntimeError: no cache here)" in found[0]

    class Keeps(nn.Module):  # handed a state it leaves as it was
        def forward(self, hidden, state=None):
            return hidden, state

    found = _find(_Base([Keeps(), Keeps()], _shared_state))
    assert found[0] == "it leaves no state in its argument `state`"


def test_an_owned_index_is_one_index_of_one_axis():
    changed = torch.zeros(4, 3, dtype=torch.bool)
    changed[:, 1] = True
    assert handed._owned_index(changed) == (2, 1)
    changed[0, 0] = True  # a second column touched: the whole tensor
    assert handed._owned_index(changed) == (None, None)
    one = torch.zeros(4, 3, dtype=torch.bool)
    one[2, 1] = True  # one element: one index on both axes, so neither is the layer's
    assert handed._owned_index(one) == (None, None)


def test_a_call_starts_each_row_at_its_first_real_token_from_the_initial_value():
    """`run`: a garbage slot is replaced by the forward's initial value (-5, not zeros: the block's
    running maximum would show a zero) at each row's first real token; a row starting after left
    pads goes token by token and equals the block run on its real tokens alone."""
    from kvwire.models.generic import state as state_slots

    torch.manual_seed(0)
    base = _Base([_ColumnBlock(i) for i in range(L)], _shared_state)
    block, states = base.blocks[1], _find(base)[1]
    call = lambda x, t, given, row=None: block(x, **given)
    slot = tuple(torch.full(shape, 7.0) for shape in state_slots.spec(states.states, B))
    x = torch.randn(B, T, D)
    real = torch.ones(B, T)
    real[0, :2] = 0
    starts = torch.zeros(B, T)
    starts[0, 2] = starts[1, 0] = 1
    with torch.no_grad():
        out, left = states.run(call, x, slot, real, starts, torch.float32)
        for row, first in ((0, 2), (1, 0)):
            alone = x[row:row + 1, first:]
            fresh = _shared_state(alone)
            want, _ = block(alone, state=fresh)
            torch.testing.assert_close(out[row:row + 1, first:], want)
            torch.testing.assert_close(left[1][row].flatten(), fresh[0][0, :, 1])
    assert ((out - x)[1] < 0).any()  # a running maximum below 0 somewhere: a zero start would have shown
