"""`RowRunner`: one steered model's variants (strengths, bounds, feature values) as the rows of one
batch, with what they share computed once.

Two things can be shared:
- the blocks below the first steered one. A steered model differs from its base only from the
  first block holding a layer with runtime inputs (the boundary) onwards. The runner cuts the
  steered backbone's layer graph there: the part below runs once per text, the part above once per
  (variant, text) row, each row with its own runtime inputs, starting from the shared states
  (`_Given` hands them in);
- the prompt, when the operation leaves it alone (a schedule such as "generated": only the answer
  is steered). Then the whole model runs over each text's prompt once, and each row continues from
  a copy of that cache with its answer tokens alone (chunked prefill of the cached graph).
Every graph is a cached graph (`kw.with_cache`), so rows are left-padded as in generation and every
steering operation, gate and inner edit works as it does when generating.
"""
import contextlib
import contextvars

import torch

from ..generate.session import left_pad
from ..graph import clone, current_call, numbered_blocks, with_cache
from ..graph.release import recompile
from ..graph.trace import layer_calls, trace
from ..layers.base import Layer
from .schedule import Scheduled

_STATES = contextvars.ContextVar("kvwire_row_states")


class _Given(Layer):
    """Stands in for the graph below the boundary: token_ids (B, T) -> the states (B, T, D) the
    runner computed there for these rows."""

    def forward(self, token_ids):
        states = _STATES.get()
        assert states.shape[:2] == token_ids.shape, (tuple(states.shape), tuple(token_ids.shape))
        return states


def _calls_by_block(backbone):
    """(layer-depth graph of `backbone`, [(call node, block index or None, block name or None)] in
    graph order): one trace for `block_starts` and `boundary`."""
    gm = trace(backbone, depth="layer")
    owner = {name: i for i, name in numbered_blocks(backbone).items()}
    calls = []
    for node in layer_calls(gm):
        name = next((n for n in owner if node.target == n or node.target.startswith(n + ".")), None)
        calls.append((node, None if name is None else owner[name], name))
    return gm, calls


def block_starts(backbone, calls=None):
    """{block index: the layer-depth call whose input is the block's input (its `resid_pre` site,
    or the block's own call where it is one call)} for the blocks that have one."""
    starts = {}
    for node, block, name in calls or _calls_by_block(backbone)[1]:
        if block is not None and block not in starts:
            starts[block] = node.target if node.target in (name, f"{name}.resid_pre") else None
    return {block: call for block, call in starts.items() if call is not None}


def boundary(backbone):
    """The layer-depth call whose input is the first steered block's input (see `block_starts`), or
    None when nothing below it can be shared (the first block, no layer with runtime inputs, or a
    block with no such call)."""
    gm, calls = _calls_by_block(backbone)
    block = None
    for node, owner, _ in calls:
        block = block if owner is None else owner
        if getattr(gm.get_submodule(node.target), "runtime_inputs", None):
            break
    else:
        return None
    first = min((owner for _, owner, _ in calls if owner is not None), default=None)
    if block is None or block == first:
        return None
    return block_starts(backbone, calls).get(block)


def split_at(backbone, call):
    """(lower, upper): `backbone`'s layer graph cut at `call`'s input. lower(token_ids (B, T)) ->
    that input (B, T, D); upper(token_ids) -> the backbone's output, computed from the states that
    `given` hands in there (what is below is not run)."""
    return _cut(backbone, call, "lower"), upper_from(backbone, call)


def upper_from(backbone, call):
    """The upper part of `split_at(backbone, call)` alone."""
    return _cut(backbone, call, "upper")


@contextlib.contextmanager
def given(states):
    """Hand `states` (B, T, D) to the upper part of a `split_at` (or a cached form of it) for the
    calls made inside."""
    token = _STATES.set(states)
    try:
        yield
    finally:
        _STATES.reset(token)


def _cut(backbone, call, part):
    """The layer graph of `backbone` below `call`'s input (part "lower": returns that input) or
    from it on (part "upper": `_Given` supplies it)."""
    seen = {}

    def fn(layer, *args, **kwargs):
        if current_call() == call and "x" not in seen:
            seen["x"] = args[0].node.name
            if part == "upper":
                return layer(_Given()(args[0]), *args[1:], **kwargs)
        return layer(*args, **kwargs)

    gm = clone(backbone, fn, depth="layer")
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    if part == "lower":
        output = next(n for n in graph.nodes if n.op == "output")
        output.args = (nodes[seen["x"]],)
    else:
        given = next(n for n in graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), _Given))
        given.args = (placeholder,)  # token_ids: what is below it is no longer read
    graph.eliminate_dead_code()
    graph.lint()
    return recompile(gm)


class RowRunner:
    """Hidden states of `steered` for texts x variants, what the rows share run once per text.

    Args:
        steered: a CausalLM (any steering edits already in it).
        split: False runs the whole model per row (nothing shared; what sharing saves is measured
            against it in bench/steer_eval.py).
        varies: the names of the runtime inputs that differ between rows (an operation's). When
            `encode` is given prompt lengths and every layer reading one of them leaves each
            row's prompt alone (its schedule starts at or after the prompt's end), the prompt is
            run once per text and rows run their answer tokens only.

    `encode(rows, prompts=)` left-pads token-id lists once; `final(batch, inputs, which)` gives the
    final hidden states (R, T', D) of rows `which` (R,) (indices into the texts) with runtime
    inputs {name: (R,) tensor} (those left out take their defaults, a schedule's from the prompt
    lengths); the caller picks how many rows a call. T' <= T: the columns are the last T' of the
    left-padded texts (a text's tokens are right-aligned, so position p of a text of length L is
    column T' - L + p), at least each row's answer tokens and the prompt token before them.
    Calls that run the rows of the same texts together share one prompt run.

    Example:
        >>> runner = RowRunner(lm.steer(vec, 0.0, name="eval"))
        >>> batch = runner.encode([lm.encode("Hi there")])
        >>> h = runner.final(batch, {"eval_strength": torch.tensor([-2.0, 2.0])}, torch.tensor([0, 0]))
        >>> h.shape   # (2, T, D): one row per strength
    """

    def __init__(self, steered, split=True, varies=()):
        call = boundary(steered.backbone) if split else None
        lower, upper = (None, None) if call is None else split_at(steered.backbone, call)
        self.lower = None if call is None else with_cache(lower)
        self.upper = steered.cached if call is None else with_cache(upper)
        self.whole = steered.cached
        self.split, self.varies = split, frozenset(varies)
        self.device = steered.device

    @property
    def runtime_inputs(self):
        return self.upper.runtime_inputs

    def encode(self, rows, chunk=64, prompts=None):
        """Token-id lists -> a batch: ids, positions, mask (N, T) left-padded, lengths (N,), prompts
        (N,) (each text's prompt length, or None: no prompt, every position may be steered), whether
        the prompts are shared, and the states at the boundary (N, T, D), computed here once,
        `chunk` rows a call (None without a boundary or when the prompts are shared)."""
        ids, positions, pads = left_pad(rows, device=self.device)
        mask = torch.arange(ids.shape[1], device=self.device)[None] >= pads[:, None]
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        if prompts is not None:
            prompts = torch.as_tensor(prompts, dtype=torch.int64, device=self.device)
            if prompts.shape != lengths.shape or bool(((prompts < 1) | (prompts > lengths)).any()):
                raise ValueError(f"prompts must give each of the {len(rows)} texts a prompt length in 1..its length; "
                                 f"got {prompts.tolist()} for lengths {lengths.tolist()}")
        shared = prompts is not None and self.prompt_untouched(prompts)
        states = None
        if self.lower is not None and not shared:
            parts = []
            for i in range(0, len(rows), chunk):
                cache = self.lower.init_cache(len(ids[i:i + chunk]), ids.shape[1])
                parts.append(self.lower(ids[i:i + chunk], positions[i:i + chunk], 0, mask[i:i + chunk], cache)[0])
            states = torch.cat(parts)
        return {"ids": ids, "positions": positions, "mask": mask, "states": states, "lengths": lengths,
                "prompts": prompts, "shared": shared, "prefix": None}

    def prompt_untouched(self, prompts):
        """Whether rows of the texts with prompt lengths `prompts` (N,) compute their prompts alike:
        every layer reading an input in `varies` is a schedule (at any depth of an inner-site chain)
        that starts at or after each prompt's end and whose bounds do not vary."""
        if not self.split or not self.varies:
            return False
        for layer in self.whole.readers:
            for leaf in _leaves(layer):
                read = set(getattr(leaf, "runtime_inputs", None) or {})
                if not read & self.varies:
                    continue
                if not isinstance(leaf, Scheduled) or {f"{leaf.name}_start", f"{leaf.name}_end"} & self.varies:
                    return False
                if bool((leaf.runtime_defaults(len(prompts), prompts)[f"{leaf.name}_start"] < prompts).any()):
                    return False
        return True

    def final(self, batch, inputs, which):
        """Final hidden states (R, T', D) of texts `which` (R,) with per-row `inputs` {name: (R,)}."""
        graph = self.whole if batch["shared"] else self.upper
        if batch["prompts"] is not None:  # a schedule's bounds from each row's prompt
            inputs = {**graph.default_inputs(len(which), batch["prompts"][which]), **inputs}
        if batch["shared"]:
            return self._answers(batch, inputs, which)
        first = batch["ids"].shape[1] - int(batch["lengths"][which].max())  # columns all padding
        ids, positions, mask = (batch[k][which, first:] for k in ("ids", "positions", "mask"))
        cache = self.upper.init_cache(len(which), ids.shape[1])
        with given(None if batch["states"] is None else batch["states"][which, first:]):
            hidden, _ = self.upper(ids, positions, 0, mask, cache, **inputs)
        return hidden

    def _answers(self, batch, inputs, which):
        """`final` with shared prompts: the rows continue copies of their texts' prompt cache."""
        texts, row = torch.unique(which, return_inverse=True)
        if batch["prefix"] is None or not torch.equal(batch["prefix"][0], texts):
            batch["prefix"] = (texts, *self._prompts(batch, texts))  # kept for the next call's rows
        _, first, split, cache = batch["prefix"]
        cache = tuple(tuple(part[row] for part in pair) for pair in cache)  # copies: written below
        ids, positions = (batch[k][which, split:] for k in ("ids", "positions"))
        hidden, _ = self.whole(ids, positions, split - first, batch["mask"][which, first:], cache, **inputs)
        return hidden

    def _prompts(self, batch, texts):
        """(first column, split column, cache): texts (G,) run up to the split column, the last one
        before every text's answer tokens and the prompt token that predicts the first of them."""
        T = batch["ids"].shape[1]
        first = T - int(batch["lengths"][texts].max())
        split = T - int((batch["lengths"][texts] - batch["prompts"][texts]).max()) - 1
        cache = self.whole.init_cache(len(texts), T - first)
        if split > first:
            ids, positions, mask = (batch[k][texts, first:] for k in ("ids", "positions", "mask"))
            inputs = self.whole.default_inputs(len(texts), batch["prompts"][texts])
            _, cache = self.whole(ids[:, :split - first], positions[:, :split - first], 0, mask, cache, **inputs)
        return first, max(split, first), cache


def _leaves(layer):
    """A layer, or the layers of its inner-site chains (`kvwire.layers.inner`)."""
    edits = getattr(layer, "edits", None)
    return [leaf for chain in edits.values() for leaf in chain] if isinstance(edits, torch.nn.ModuleDict) else [layer]
