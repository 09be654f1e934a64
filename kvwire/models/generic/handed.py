"""State a decoder layer is handed as an argument and hands back (RWKV's `state`, a list of
all-layer tensors each block writes its own index of in place; xLSTM's (c, n, m) tuple, returned
new), given a state slot like the Cache API's.

Such a model's forward, called with `use_cache=True`, makes the states itself and passes them to
each decoder layer in an argument that is None when it runs without a cache. The build finds them
(`find`) by running that forward once on its probe and watching each layer's call: the argument
that holds tensors of the probe's batch there and nothing in the uncached call is the state; the
layer's new state is an element of what it returns with the same structure, else the argument
as the call left it. A tensor the call changes is a state, and where the call changes one index of
one axis only (RWKV's per-layer column of tensors shared by every layer), only that index is.
What the forward handed the layer is its initial state (RWKV's running maximum starts at -1e30,
not zero). Nothing here is keyed by family or by the argument's name.

The layer's state slot is the pair `kvwire.models.generic.state.spec` makes, every state
flattened into its float32 "recurrent" half. A cached call builds the argument from the slot
(each tensor of the batch zeros, the layer's part put in), calls the layer with it and
`use_cache=True` where the layer takes that, and reads the parts back. These layers take no
padding mask, so, as `kvwire.models.generic.held` does, a row's state is set to the initial one
before its first real token (kvwire pads on the left only, so nothing a pad left survives), and a
chunk in which a row starts after its first column goes one token at a time. A chunk without
that, a prompt's first chunk or one that continues every row, is one call: the layer's own call
of several tokens continues the state it is handed (the build's chunked check holds it to that).
Traced calls of several tokens always step (a trace cannot look at its rows), and the loop unrolls.
"""
import functools
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ...kernels.tracing import is_exporting
from . import held, state as state_slots, stepping
from .arguments import by_name, takes, with_arguments


@dataclass(frozen=True)
class Handed(state_slots.Sized):
    """One state in a layer's state argument: the tensor's place among the argument's leaves
    (flattened as a pytree), the axis and index of the part the layer owns where it owns one index
    of a tensor shared by all layers (else None, None: the whole tensor), the part's shape without
    the batch dimension and its dtype (the model weights' where it `follows` them)."""

    leaf: int
    axis: int | None
    index: int | None
    shape: tuple
    dtype: torch.dtype
    follows: bool = False
    kind = "recurrent"  # the half of the state slot it is kept in

    def part(self, tensor):
        """The layer's part of a leaf (B, ...) of the argument."""
        return tensor if self.axis is None else tensor.select(self.axis, self.index)


@dataclass(frozen=True)
class Leaf:
    """A tensor of the state argument, by its shape without the batch dimension and its dtype."""

    shape: tuple
    dtype: torch.dtype


class HandedStates:
    """The states a decoder layer is handed in its argument `name`: how to build the argument
    (`spec`, the pytree's structure; `templates`, each leaf: a `Leaf` for a tensor of the batch, made
    zeros, else the value the probe's forward handed), the states in it ([Handed]), their initial
    values (a number where one value fills the state, else (1, *shape)), where the layer hands
    them back (`returned`: the index in its output tuple, None: written in place) and whether it
    takes `use_cache`. What `kvwire.models.generic.parts.DecoderLayer` runs a cached call with."""

    steps = False  # a call of several tokens continues the state: only chunks where a row starts late step

    def __init__(self, name, spec, templates, states, initial, returned, use_cache):
        # the argument's structure with its leaves in place: flattened for the spec in each call (a
        # spec itself does not copy cleanly with a model)
        self.name, self.structure = name, tree_unflatten(list(templates), spec)
        self.states, self.initial = list(states), list(initial)
        self.returned, self.use_cache = returned, use_cache
        # its one-token call broadcasts the state across rows (transformers' RWKV adds a (B, D) state
        # to (B, 1, D) hidden states): one-token calls of several rows run row by row (set by `find`)
        self.rows_apart = False

    def run(self, call, x, slot, real, starts, dtype, who=None):
        """(the layer's hidden states out (B, T, D), the slot after the call).

        `call(x, t, given, row)` runs the layer on x with the arguments `given` in place (t: the
        token x is, None: the whole chunk; row: the row x is, None: every row); `real` and `starts`
        (B, T) float32 are 1 at real tokens and at each row's first real token; `dtype` is the layer
        weights' (the states that follow it are handed in it); `who` the layer (named where an
        export of a dynamic chunk length is refused)."""
        B, T = real.shape
        parts = [part for _, part in state_slots.state_views(slot, self.states, dtype)]
        if not _steps(real, starts, who):
            parts = self._reset(parts, starts[:, 0])
            out, parts = self._call(call, x, None, parts)
        else:
            outs = []
            for t in range(T):
                parts = self._reset(parts, starts[:, t])
                out, parts = self._call(call, x[:, t:t + 1], t, parts)
                outs.append(out)
            out = torch.cat(outs, dim=1)
        return out, state_slots.recurrent_left(slot, [p.reshape(B, -1).to(torch.float32) for p in parts])

    def _reset(self, parts, starting):
        """Each part with the rows whose first real token is next (`starting` (B,) 1) set to its initial value."""
        new = []
        for part, initial in zip(parts, self.initial):
            s = starting.view(-1, *([1] * (part.dim() - 1))).to(part.dtype)
            start = initial if isinstance(initial, float) else initial.to(part.device, part.dtype)
            new.append(part * (1 - s) + start * s)
        return new

    def _call(self, call, x, t, parts):
        B = x.shape[0]
        if self.rows_apart and x.shape[1] == 1 and B > 1:  # its one-token step mixes rows: each row alone
            done = [self._call_once(functools.partial(call, row=b), x[b:b + 1], t, [p[b:b + 1] for p in parts])
                    for b in range(B)]
            return torch.cat([out for out, _ in done]), [torch.cat(ps) for ps in zip(*(p for _, p in done))]
        return self._call_once(call, x, t, parts)

    def _call_once(self, call, x, t, parts):
        B = x.shape[0]
        # zeros but for the layer's parts (made in the call, not constants a compiled graph would hold)
        templates, spec = tree_flatten(self.structure)
        leaves = [torch.zeros(B, *leaf.shape, dtype=leaf.dtype, device=x.device) if isinstance(leaf, Leaf) else leaf
                  for leaf in templates]
        for h, part in zip(self.states, parts):
            if h.axis is None:
                leaves[h.leaf] = part
            else:
                leaf = leaves[h.leaf].to(part.dtype)  # a state that follows the model: in its dtype
                leaf.select(h.axis, h.index).copy_(part)
                leaves[h.leaf] = leaf
        given = {self.name: tree_unflatten(leaves, spec)}
        if self.use_cache:
            given["use_cache"] = True
        out = call(x, t, given)
        # written in place: the argument as the call left it (an element of a list may be replaced)
        after = tree_flatten(given[self.name] if self.returned is None else out[self.returned])[0]
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        return hidden, [h.part(after[h.leaf]) for h in self.states]


def _steps(real, starts, who=None):
    """Whether the chunk goes one token at a time: where a row's first real token is after its first
    column (pads before it), and in every trace of several tokens (it cannot look at its rows). A row
    of pads only (an idle row) does not step: whatever it leaves is dropped when the row starts."""
    T = real.shape[1]
    stepping.refuse_dynamic_steps(T, who)
    if T == 1:
        return False
    if torch.compiler.is_compiling() or is_exporting():
        return True
    return bool(starts[:, 1:].any())  # pads come before a row's first real token only


class _Stop(BaseException):  # not an Exception: a forward catching those does not swallow it
    """Raised in a pre-hook to end a probe forward once the call it watches for is seen."""


def find(base, probe, layers, recorded):
    """{index: HandedStates or why not (str)} for the decoder layers `layers` ({index: module}),
    from one run of `base`'s forward on `probe` with `use_cache=True`, in eval mode as the build's
    probe ran (dropout off; RWKV rescales its weights on a change of mode); `recorded` holds each
    layer's uncached probe call [(hidden, args, kwargs)] (where the argument holds nothing). The
    modules' plain attributes are left as they were."""
    was_training = base.training
    base.eval()
    try:
        seen = _watch(base, probe, layers)
        if isinstance(seen, str):
            return {i: seen for i in layers}
        dtypes = _followers(base, probe, layers)
        found = {}
        for i, module in layers.items():
            hidden, args, kwargs = recorded[i]
            found[i] = _found(module, seen[i], by_name(module, args, kwargs), probe.shape[0], dtypes)
            if isinstance(found[i], HandedStates):
                found[i].rows_apart = _mixes_rows(found[i], module, hidden, args, kwargs, seen[i])
        return found
    finally:
        base.train(was_training)


def _watch(base, probe, layers):
    """{index: {"entry": the layer's arguments as handed, "exit": as the call left them, "out": what
    it returned}} of one forward of `base` with `use_cache=True` (copies), or why it failed."""
    seen = {i: {} for i in layers}

    def entered(i):
        def hook(module, args, kwargs):
            seen[i]["entry"] = _snapshot(module, args[1:], kwargs)
            seen[i]["objects"] = by_name(module, args[1:], kwargs)
        return hook

    def left(i):
        def hook(module, args, kwargs, out):
            seen[i]["exit"] = {k: _cloned(v) for k, v in seen[i]["objects"].items()}
            seen[i]["out"] = _cloned(out)
        return hook

    hooks = []
    for i, module in layers.items():
        hooks.append(module.register_forward_pre_hook(entered(i), with_kwargs=True))
        hooks.append(module.register_forward_hook(left(i), with_kwargs=True))
    before, after = held.attributes(base), {}
    try:
        with torch.no_grad():
            base(input_ids=probe, use_cache=True)
        after = held.attributes(base)
    except Exception as e:  # noqa: BLE001 - a forward that does not run with use_cache: nothing handed
        return f"its model's forward with use_cache=True fails ({type(e).__name__}: {e})"
    finally:
        for h in hooks:
            h.remove()
        held.put_back(base, before, after)
    return seen


def _mixes_rows(states, module, hidden, args, kwargs, seen):
    """Whether the layer's one-token call, handed the state its probe call left, gives its rows
    other outputs than each row alone (or another shape)."""
    after = tree_flatten(seen["exit"][states.name] if states.returned is None else seen["out"][states.returned])[0]
    parts = [h.part(after[h.leaf]).to(torch.float32) for h in states.states]
    B = hidden.shape[0]

    def call(x, t, given, row=None):
        a = tuple(stepping.at_row(v, B, row) for v in args)
        k = {name: stepping.at_row(v, B, row) for name, v in kwargs.items()}
        a, k = with_arguments(module, a, k, given)
        return module(x, *a, **k)

    x = hidden[:, -1:]
    with torch.no_grad():
        try:
            together, _ = states._call_once(call, x, None, parts)
            alone = torch.cat([states._call_once(functools.partial(call, row=b), x[b:b + 1], None,
                                                 [p[b:b + 1] for p in parts])[0] for b in range(B)])
        except Exception:  # noqa: BLE001 - shapes that do not fit (mixed rows): row by row, the checks decide
            return True
    return together.shape != alone.shape or not torch.allclose(together, alone, atol=1e-5, rtol=1e-4)


def _snapshot(module, args, kwargs):
    return {k: _cloned(v) for k, v in by_name(module, args, kwargs).items()}


def _cloned(tree):
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, tree)


def _tensors(tree):
    return [v for v in tree_flatten(tree)[0] if isinstance(v, torch.Tensor)]


def _batched(tree, batch_size):
    return any(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch_size for v in tree_flatten(tree)[0])


def _found(module, seen, uncached, batch_size, dtypes):
    """HandedStates of one layer from what its cached probe call `seen` (entry, exit, out), or why not."""
    if "entry" not in seen:
        return "its model's forward with use_cache=True does not call it"
    names = [n for n, v in seen["entry"].items()
             if _batched(v, batch_size) and not _tensors(uncached.get(n))]
    if len(names) != 1:
        return (f"it is handed {len(names)} arguments of tensors with use_cache=True that it is not handed "
                f"without ({', '.join(names)}); the generic path takes one state argument" if names else
                "it is handed no state argument with use_cache=True")
    name = names[0]
    entry, spec = tree_flatten(seen["entry"][name])
    returned = _returned(seen["out"], spec, entry)
    after = tree_flatten(seen["exit"][name] if returned is None else seen["out"][returned])[0]
    states, initial = [], []
    for j, (e, a) in enumerate(zip(entry, after)):
        if not isinstance(e, torch.Tensor) or e.dim() < 1 or e.shape[0] != batch_size \
                or not isinstance(a, torch.Tensor) or e.shape != a.shape:
            continue
        changed = (e != a).any(dim=0)
        if not changed.any():
            continue
        axis, index = _owned_index(changed)
        h = Handed(j, axis, index, (), e.dtype, follows=dtypes.get((name, j)) == torch.bfloat16)
        start = h.part(e)
        if not (start == start[:1]).all():
            return f"its initial state `{name}` differs between rows"
        states.append(Handed(j, axis, index, tuple(start.shape[1:]), e.dtype, h.follows))
        # one value throughout (zeros, RWKV's -1e30) is kept as a number: no constant in a compiled graph
        initial.append(start.flatten()[0].item() if (start == start.flatten()[0]).all() else start[:1].float())
    if not states:
        return f"it leaves no state in its argument `{name}`"
    templates = [Leaf(tuple(e.shape[1:]), e.dtype) if isinstance(e, torch.Tensor) and e.dim() >= 1
                 and e.shape[0] == batch_size else e for e in entry]
    use_cache = takes(module, "use_cache", {})
    return HandedStates(name, spec, templates, states, initial, returned, use_cache)


def _returned(out, spec, entry):
    """The index in the layer's output tuple of its new state (the argument's structure and shapes),
    or None (written in place)."""
    if not isinstance(out, (tuple, list)):
        return None
    for k, value in enumerate(out):
        leaves, s = tree_flatten(value)
        if k and s == spec and all(not isinstance(a, torch.Tensor) or (isinstance(b, torch.Tensor)
                                                                       and a.shape == b.shape)
                                   for a, b in zip(leaves, entry)):
            return k
    return None


def _owned_index(changed):
    """(axis of the leaf with its batch, index) where `changed` (the leaf's shape without the batch)
    is True at one index of one axis only (of several), else (None, None): the whole tensor."""
    owned = []
    for a in range(changed.dim()):
        if changed.shape[a] < 2:
            continue
        hit = changed.movedim(a, 0).reshape(changed.shape[a], -1).any(dim=1)
        if int(hit.sum()) == 1:
            owned.append((a + 1, int(hit.nonzero()[0, 0])))
    return owned[0] if len(owned) == 1 else (None, None)


def _followers(base, probe, layers):
    """{(argument, leaf): dtype} of the state argument the forward hands the first of `layers` when
    run on input embeddings in bfloat16 (stopped there): the states it makes in the model's dtype.
    Empty where the forward does not take input embeddings or fails before the layer."""
    first = layers[min(layers)]
    got = {}

    def hook(module, args, kwargs):
        for name, value in by_name(module, args[1:], kwargs).items():
            for j, leaf in enumerate(tree_flatten(value)[0]):
                if isinstance(leaf, torch.Tensor):
                    got[(name, j)] = leaf.dtype
        raise _Stop

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    before, after = held.attributes(base), {}
    try:
        with torch.no_grad():
            embeds = base.get_input_embeddings()(probe).to(torch.bfloat16)
            base(inputs_embeds=embeds, use_cache=True)
    except _Stop:
        after = held.attributes(base)
    except Exception:  # noqa: BLE001 - no answer: every state keeps its found dtype
        return {}
    finally:
        handle.remove()
        held.put_back(base, before, after)
    return got
