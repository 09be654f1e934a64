"""Calling a compiled decode step's Inductor function directly, past dynamo's frame machinery.

Even with its guards skipped, a dynamo call of a decode step spends a good part of the step before
Inductor's code runs: the cache lookup walks the ~370 graph inputs (every weight is fetched again
through its module path each call) and a bytecode prologue builds their list. The compiled function
itself needs only that list in a fixed order, and all but the step's own arguments (token ids,
positions, masks, caches) are the same weight tensors on every call. So the backend here records,
for a graph compiled from one call, which of its inputs are that call's arguments (by identity)
and holds the rest; later calls with the same signature fill in their arguments and call Inductor's
function directly (docs/kernels.md, Measurements; `python bench/compile_options.py
'{"kvwire_dynamo": true}' '{}'` compares the two).

A recorded graph is used only when it can stand in for the whole dynamo call, checked on the call
that compiled it: one graph (no graph break), tensor inputs only (a dynamic prompt length passes a
size: those keep dynamo), the step's cache returned as the same tensors it was given (written in
place, so dynamo's result is the one graph output plus those caches), and the direct call's logits
equal to dynamo's, bit for bit. That check runs the step again on copies of the caches as the
compiling call found them, never on the caches themselves: a step of a ring cache reads the slot
it then overwrites (window 5 in 4 slots: position 28 attends to position 24 in slot 0, then writes
itself there), so a second run in place attended to its own key instead and wrote wrong keys and
values for every layer after the first (the tokens parted from eager's a few steps later).
"""
import torch


class DirectCalls:
    """A `torch.compile` backend (Inductor with `options`) that also keeps what a direct call of
    each compiled step needs; `entry(args, out)` makes one from the call that compiled it.

    Example:
        >>> direct = DirectCalls({})
        >>> step = torch.compile(fn, dynamic=False, backend=direct)  # doctest: +SKIP
    """

    def __init__(self, options):
        self.options = options
        self.compiled = []  # (example inputs, Inductor function) of the call being compiled

    def __call__(self, gm, example_inputs):
        fn = torch._inductor.compile(gm, example_inputs, self.options)
        self.compiled.append((list(example_inputs), fn))
        return fn

    def start(self):
        """Forget graphs from earlier calls: the next call's compiles are recorded from empty."""
        self.compiled = []

    def entry(self, flat, cache, out, before):
        """A `DirectStep` for the call that just ran dynamo on the tensors `flat` (`flat_args` of
        its arguments), `cache` among them, and returned `out` (logits, cache), or None when its
        compiled graph cannot stand in for the call. `before`: copies of the cache's tensors (key,
        value per layer) as that call found them; the check re-runs the step on them."""
        compiled, self.compiled = self.compiled, []
        if len(compiled) != 1 or not _same_cache(cache, out):
            return None
        example, fn = compiled[0]
        if not all(isinstance(t, torch.Tensor) for t in example):
            return None
        position = {id(t): i for i, t in enumerate(flat)}
        if len(position) != len(flat):  # one tensor in two arguments: dynamo made one input of it
            return None
        step = DirectStep(fn, [None if id(t) in position else t for t in example],
                          [(slot, position[id(t)]) for slot, t in enumerate(example) if id(t) in position])
        first = position[id(cache[0][0])] if cache else len(flat)  # the caches' tensors come in a row
        try:
            outputs = step.outputs(flat[:first] + list(before) + flat[first + len(before):])
        except Exception:  # noqa: BLE001 - whatever it is, dynamo's call still serves this signature
            return None
        return step if len(outputs) == 1 and torch.equal(outputs[0], out[0]) else None


class DirectStep:
    """fn(*inputs) with the weights held and a call's tensors put in their slots:
    step(flat, cache) -> (logits, cache), flat as `flat_args` gives them."""

    def __init__(self, fn, held, fills):
        self.fn, self.held, self.fills = fn, held, fills

    def __call__(self, flat, cache):
        return self.outputs(flat)[0], cache

    def outputs(self, flat):
        inputs = self.held.copy()  # Inductor clears its input list: a fresh one each call
        for slot, i in self.fills:
            inputs[slot] = flat[i]
        return self.fn(*inputs)


def packed(t):
    """`t` with row-major strides. A slice such as `ids[:, -1:]` of one row counts as contiguous
    yet keeps its parent's row stride, and compiled steps are keyed on strides: without this every
    prompt length would key (and build) a step of its own."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    return t if list(t.stride()) == expected[::-1] else t.clone(memory_format=torch.contiguous_format)


def flat_args(args):
    """(token_ids, positions, cache_index, attention_mask, cache, *extra) -> its tensors in that
    order, each cache pair's key then value."""
    token_ids, positions, cache_index, attention_mask, cache, *extra = args
    flat = [token_ids, positions, cache_index, attention_mask]
    for pair in cache:
        flat.extend(pair)
    return flat + extra


def _same_cache(cache, out):
    """Whether dynamo's result is (logits tensor, the given cache's own tensors)."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
        return False
    returned = out[1]
    return len(returned) == len(cache) and all(
        len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(returned, cache))
