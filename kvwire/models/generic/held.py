"""State a token mixer keeps in attributes of its own modules, outside transformers' Cache API
(RecurrentGemma's convolution and RG-LRU), given a state slot like the Cache API's.

Such a mixer, called with `use_cache=True`, sets plain tensor attributes of its modules
(`self.conv1d_state`, `self.rg_lru.recurrent_states`) and continues from them in its next call. The
build finds them (`find`) by running the decoder layer once on its recorded probe call with
`use_cache=True` and comparing its modules' attributes before and after: a tensor the call left in
an attribute, its first size the probe's batch, is a state. Nothing here is keyed by family.

The layer's state slot is the pair `kvwire.models.generic.state.spec` makes, every attribute
flattened into its float32 "recurrent" half (the "conv" half is one unused column). A cached call
(`holding`) sets each attribute to its part of the slot, runs the layer, reads the attributes back
into the slot and puts back what they held before: the modules are left as found, so
transformers' own forward and `generate` on the same model are untouched.

Such a mixer takes no padding mask, and its call of several tokens need not continue what it is
handed (RecurrentGemma's convolution restarts from zeros). So a chunk goes through it one token at
a time, each token sliced from its per-token arguments, unless every row starts in the chunk's
first column with no pads (a prompt's first chunk: the mixer's own call from a zero state). Before
each token the rows whose first real token it is (position 0, not a pad) start from zeros, as
transformers does without a state: what the row's left pads left in the state is dropped (kvwire
pads on the left only, so no pad comes after a row's first real token). T is static in a trace:
traced calls of several tokens always step,
and the loop unrolls (an export with a dynamic chunk length is refused, as
`kvwire.models.generic.stepping` refuses one).
"""
import functools
import inspect
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...kernels.tracing import is_exporting
from . import seam, state as state_slots, stepping
from .scoped import Scoped

_plan = Scoped(None)
INSTALLED = "_kvwire_held_steps"  # on a mixer whose forward `install` wrapped


@dataclass(frozen=True)
class Held(state_slots.Sized):
    """One tensor a mixer keeps in a module attribute: the module's path inside the decoder layer,
    the attribute's name, its shape without the batch dimension and its dtype."""

    path: str
    name: str
    shape: tuple
    dtype: torch.dtype
    follows: bool = False  # its dtype is the model weights' (a cast model's), not fixed (a float32 accumulator)
    kind = "recurrent"  # the half of the state slot it is kept in (`kvwire.models.generic.state.spec`)

    @property
    def key(self):
        """What names it among the states a call leaves (`kvwire.models.generic.state.with_followers`)."""
        return self.path, self.name


def attributes(block):
    """{(path, name): value} of the plain attributes of `block`'s modules that hold a tensor or None
    (parameters and buffers are not plain attributes)."""
    return {(path, name): value for path, module in block.named_modules()
            for name, value in vars(module).items()
            if not name.startswith("__") and (value is None or isinstance(value, torch.Tensor))}


def find(block, call, batch_size):
    """[Held] of the decoder layer `block`: the tensors `call()` (its probe call with `use_cache=True`)
    left in its modules' attributes, their first size `batch_size`, in a fixed order. The attributes
    are put back as they were."""
    before = attributes(block)
    after = {}
    try:
        call()
        after = attributes(block)
    finally:
        put_back(block, before, after)
    held = [Held(path, name, tuple(value.shape[1:]), value.dtype) for (path, name), value in sorted(after.items())
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch_size
            and value is not before.get((path, name))]
    return held


def mixer_path(held):
    """The path of the innermost module holding every attribute in `held` ("" the layer itself)."""
    parts = [h.path.split(".") if h.path else [] for h in held]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


class HeldStates:
    """The states a decoder layer's mixer keeps in attributes (`held`, [Held]) and the path of that
    mixer: what `kvwire.models.generic.parts.DecoderLayer` runs a cached call with."""

    steps = True  # chunks continuing a state go one token at a time (see the module docstring)

    def __init__(self, held, mixer):
        self.states, self.mixer = list(held), mixer

    @contextmanager
    def holding(self, block, slot, real, starts, dtype):
        """Inside: `block`'s attributes hold `slot`'s states and its mixer (`install`ed) steps as the
        module docstring says; `real` (B, T) float32 1 for real tokens, `starts` (B, T) float32 1 at
        each row's first real token, `dtype` the layer weights' (that of the states that follow it).
        Yields a list whose one item, after the block, is the slot the call leaves (written in place
        in eager calls)."""
        B = real.shape[0]
        mixer = seam.unproxied(block.get_submodule(self.mixer))
        steps = _steps(real, starts, mixer)  # before any attribute is set: it may refuse the call
        # the modules themselves: torch.export's tracer may hand out stand-ins for them, and the
        # mixer's code reads its attributes on the module
        owners = [seam.unproxied(block.get_submodule(h.path)) for h in self.states]
        before = [getattr(m, h.name) for m, h in zip(owners, self.states)]
        token, left = _plan.set(_Plan(mixer, list(zip(owners, self.states)), starts, steps)), []
        try:
            for m, (h, part) in zip(owners, state_slots.state_views(slot, self.states, dtype)):
                setattr(m, h.name, part)
            yield left
            left.append(self._close(owners, slot, B))
        finally:  # the attributes as they were, whatever happened
            _plan.reset(token)
            for m, h, value in zip(owners, self.states, before):
                setattr(m, h.name, value)

    def _close(self, owners, slot, B):
        parts = [getattr(m, h.name).reshape(B, -1).to(torch.float32) for m, h in zip(owners, self.states)]
        return state_slots.recurrent_left(slot, parts)


@dataclass
class _Plan:
    mixer: torch.nn.Module
    held: list  # [(module, Held)]
    starts: torch.Tensor
    steps: bool


def _steps(real, starts, mixer):
    """Whether the chunk goes one token at a time: always but where every row starts in its first
    column with no pads (checked in eager calls only: a trace cannot look at its rows)."""
    T = real.shape[1]
    stepping.refuse_dynamic_steps(T, mixer)
    if T == 1 or torch.compiler.is_compiling() or is_exporting():
        return True
    return not bool(real.all() and starts[:, 0].all())


def install(mixer):
    """Make `mixer`'s forward follow the plan `HeldStates.holding` sets (once); its signature stays
    its class's."""
    if getattr(mixer, INSTALLED, False):
        return

    own_forward = type(mixer).forward

    def forward(self, *args, **kwargs):
        # the class's function called with self, not a bound method: dynamo remakes a module's
        # bound method after a graph break as self.forward, which is this one
        plan = _plan.get()
        if plan is None or plan.mixer is not seam.unproxied(self):
            return own_forward(self, *args, **kwargs)
        if not plan.steps:  # every row starts afresh in its first column: the mixer's own call from zeros
            reset_starting_rows(plan, 0)
            return own_forward(self, *args, **kwargs)
        return stepping.one_at_a_time(functools.partial(own_forward, self), args, kwargs,
                                      before=functools.partial(reset_starting_rows, plan))

    forward.__signature__ = inspect.signature(type(mixer).forward)
    mixer.forward = types.MethodType(forward, mixer)
    setattr(mixer, INSTALLED, True)


def reset_starting_rows(plan, t):
    """Scale each attribute's rows by 1 - starts[:, t]: rows whose first real token is t start from zeros."""
    for module, h in plan.held:
        value = getattr(module, h.name)
        keep = (1.0 - plan.starts[:, t]).view(-1, *([1] * len(h.shape))).to(value.dtype)
        setattr(module, h.name, value * keep)


def put_back(block, before, after):
    """Attributes as they were `before` a call; those it added removed."""
    for (path, name), value in before.items():
        setattr(block.get_submodule(path), name, value)
    for path, name in after.keys() - before.keys():
        delattr(block.get_submodule(path), name)
