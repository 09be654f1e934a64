"""State a mixer keeps in the model's own cache class, outside transformers' Cache API layers
(MiniMax's lightning attention: `cache.get_linear_cache(i)` / `cache.set_linear_cache(i, state)`),
given a state slot like the Cache API's.

Such a model's forward makes an object of its own `Cache` subclass when called with `use_cache=True`
and its mixers read and write their state through methods only that class has, so transformers'
plain `Cache` (`kvwire.models.generic.state.probe_cache`) fails them. The build finds the class on
the object the base model's forward returns (`own_class`), and what a decoder layer keeps in it
(`find`) by calling the layer once on its recorded probe call with a fresh object of the class and
comparing the object's attributes before and after: every tensor the call left, looked for inside
lists, tuples and dicts too (`self.linear_cache[i]`), its first size the probe's batch, is a state.
Nothing here is keyed by family or by the class's method names.

A cached call (`OwnedStates.open`) makes a fresh object of the class and sets those attributes to
what the probe left, each state replaced by its view of the layer's slot, so the mixer finds a
previous state and continues it (MiniMax then steps token by token itself, exact for chunks and
decode alike); `close` reads the states back. An eager chunk in which every row starts afresh
(a prompt's first chunk) hands the object empty: the mixer's own call without a state, as
transformers prefills a prompt (MiniMax's blockwise form; left pads masked out by the padding mask). `OwnedStates` has `StateCache`'s interface, so the
decoder layer runs it as any Cache-API state: rows starting in the chunk scaled to zero, the
chunk's padding mask as the layer's `attention_mask`, the slot flattened into the float32
"recurrent" half of the pair `kvwire.models.generic.state.spec` makes.
"""
import functools
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...kernels.tracing import is_exporting
from . import held, state as state_slots, stepping


@dataclass(frozen=True)
class Owned(state_slots.Sized):
    """One tensor a layer leaves in the model's own cache object: the attribute's name, the tensor's
    place among the attribute's leaves (its value flattened as a pytree), its shape without the
    batch dimension and its dtype (the model weights' where it `follows` them)."""

    name: str
    leaf: int
    shape: tuple
    dtype: torch.dtype
    follows: bool = False
    kind = "recurrent"  # the half of the state slot it is kept in

    @property
    def key(self):
        """What names it among the states a call leaves (`kvwire.models.generic.state.with_followers`)."""
        return self.name, self.leaf


def own_class(base, probe, cache_name):
    """(the model's own cache class or None, why none): the class of the cache object `base`'s
    forward returns for `probe` with `use_cache=True` and no cache given, where it is a transformers
    `Cache` subclass defined outside transformers' `cache_utils`. The modules' plain attributes are
    left as they were (a mixer keeping state in them sets them in this call)."""
    from transformers.cache_utils import Cache

    if cache_name is None:
        return None, "its forward takes no cache"
    positions = torch.arange(probe.shape[1], device=probe.device)[None].expand(probe.shape[0], -1)
    before, after = held.attributes(base), {}
    try:
        with torch.no_grad():
            out = base(input_ids=probe, position_ids=positions, use_cache=True, **{cache_name: None})
        after = held.attributes(base)
    except Exception as e:  # noqa: BLE001 - a forward that does not run so: no class of its own found
        return None, f"its forward with use_cache=True fails ({type(e).__name__}: {e})"
    finally:
        held.put_back(base, before, after)
    values = out.values() if hasattr(out, "values") else out if isinstance(out, tuple) else ()
    made = next((v for v in values if isinstance(v, Cache)), None)
    if made is None or type(made).__module__ == Cache.__module__:
        return None, "its forward makes no cache class of its own"
    return type(made), None


def maker(cls, config):
    """make() -> a new, empty object of the cache class `cls`: `cls()`, or `cls(config=config)` where
    that fails (decided once, here, not at every call)."""
    try:
        cls()
        return cls
    except Exception:  # noqa: BLE001 - a class that needs its config (any error its __init__ raises then)
        cls(config=config)
        return functools.partial(cls, config=config)


def _leaves(cache):
    """{name: (leaves, spec)} of `cache`'s plain attributes, each value flattened as a pytree."""
    return {name: tree_flatten(value) for name, value in vars(cache).items() if not name.startswith("__")}


def find(make, call, batch_size):
    """([Owned], {name: (leaves, spec)} of the attributes holding them) that `call(cache)` (a decoder
    layer's probe call handed `cache`, a fresh object from `make()`) leaves in the object. Raises
    ValueError where an attribute holding a state also holds another tensor the call left (the
    layer's next call would be handed the probe's)."""
    cache = make()
    before = _leaves(cache)
    call(cache)
    after = _leaves(cache)
    owned, layouts = [], {}
    for name, (leaves, spec) in sorted(after.items()):
        old = {id(v) for v in before.get(name, ([], None))[0]}
        new = [(i, v) for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and id(v) not in old]
        states = [(i, v) for i, v in new if v.dim() >= 1 and v.shape[0] == batch_size]
        if not states:
            continue
        if len(states) != len(new):
            raise ValueError(f"the layer leaves tensors in its cache's `{name}` that are not states of the batch's "
                             f"rows ({[tuple(v.shape) for _, v in new]} for {batch_size} rows)")
        owned += [Owned(name, i, tuple(v.shape[1:]), v.dtype) for i, v in states]
        layouts[name] = (leaves, spec)
    return owned, layouts


def afresh(keep):
    """Whether every row starts afresh in the chunk (`keep` (B,) all 0), seen in eager calls only (a
    trace cannot look at its rows: it always hands the state)."""
    if torch.compiler.is_compiling() or is_exporting():
        return False
    return not bool(keep.any())


class OwnedStates:
    """The states a decoder layer keeps in the model's own cache object (`states`, [Owned]), with
    `kvwire.models.generic.state.StateCache`'s interface: what `kvwire.models.generic.parts.DecoderLayer`
    runs a cached call with."""

    def __init__(self, states, layouts, make, use_cache=False):
        self.states, self.layouts, self.make = list(states), layouts, make
        self.steps = False  # set by the build's chunked check, as for Cache-API states
        self.use_cache = use_cache  # the layer is called with use_cache=True, as the model's forward calls it to cache

    def open(self, slot, keep, steps=False, dtype=None):
        """A fresh object of the model's cache class whose attributes hold `slot`'s states (rows
        scaled by `keep` (B,), 0: start afresh; those that follow the model in `dtype`)."""
        cache = self.make()
        if afresh(keep):
            return cache  # every row starts in this chunk: the mixer's own call without a state
        values = {s.key: part for s, part in state_slots.state_views(slot, self.states, dtype, keep)}
        for name, (leaves, spec) in self.layouts.items():
            setattr(cache, name, tree_unflatten([values.get((name, i), v) for i, v in enumerate(leaves)], spec))
        if steps:
            setattr(cache, stepping.MARK, True)
        return cache

    def close(self, cache, slot):
        """The slot after the call: the states the layer left in `cache`, flattened back (written into
        `slot` in place in eager calls)."""
        B = slot[1].shape[0]
        leaves = {name: tree_flatten(getattr(cache, name))[0] for name in self.layouts}
        parts = [leaves[s.name][s.leaf].reshape(B, -1).to(torch.float32) for s in self.states]
        return state_slots.recurrent_left(slot, parts)
