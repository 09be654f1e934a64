"""`RowRunner`: one steered model's variants (strengths, bounds, feature values) as the rows of one
batch, with the blocks they share computed once.

A steered model differs from its base only from the first block holding a layer with runtime
inputs (the boundary) onwards. The runner cuts the steered backbone's layer graph there: the part
below runs once per text, the part above once per (variant, text) row, each row with its own
runtime inputs, starting from the shared states (`_Given` hands them in). Both parts are cached
graphs (`kw.with_cache`), so rows are left-padded as in generation and every steering operation,
gate and inner edit works as it does when generating.
"""
import contextvars

import torch

from ..generate.session import left_pad
from ..graph import clone, current_call, numbered_blocks, with_cache
from ..graph.release import recompile
from ..graph.trace import layer_calls, trace
from ..layers.base import Layer

_STATES = contextvars.ContextVar("kvwire_row_states")


class _Given(Layer):
    """Stands in for the graph below the boundary: token_ids (B, T) -> the states (B, T, D) the
    runner computed there for these rows."""

    def forward(self, token_ids):
        states = _STATES.get()
        assert states.shape[:2] == token_ids.shape, (tuple(states.shape), tuple(token_ids.shape))
        return states


def boundary(backbone):
    """The layer-depth call whose input is the first steered block's input (that block's
    `resid_pre` site, or the block's own call where it is one call), or None when nothing below
    it can be shared (the first block, or no layer with runtime inputs)."""
    gm = trace(backbone, depth="layer")
    owner = {name: i for i, name in numbered_blocks(backbone).items()}
    block, first = None, {}
    for node in layer_calls(gm):
        name = next((n for n in owner if node.target == n or node.target.startswith(n + ".")), None)
        if name is not None:
            block = owner[name]
            first.setdefault(block, node.target)
        if getattr(gm.get_submodule(node.target), "runtime_inputs", None):
            break
    else:
        return None
    if block is None or block == min(owner.values()):
        return None
    call, name = first[block], next(n for n, i in owner.items() if i == block)
    return call if call in (name, f"{name}.resid_pre") else None


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
    """Hidden states of `steered` for texts × variants, the part below the boundary run once per text.

    Args:
        steered: a CausalLM (any steering edits already in it).
        split: False runs the whole model per row (no shared part; what batching saves is measured
            against it in bench/steer_eval.py).

    `encode(rows)` left-pads token-id lists once; `final(batch, inputs, which)` gives the final
    hidden states (R, T, D) of rows `which` (R,) (indices into the texts) with runtime inputs
    {name: (R,) tensor} (those left out take their defaults); the caller picks how many rows a call.

    Example:
        >>> runner = RowRunner(lm.steer(vec, 0.0, name="eval"))
        >>> batch = runner.encode([lm.encode("Hi there")])
        >>> h = runner.final(batch, {"eval_strength": torch.tensor([-2.0, 2.0])}, torch.tensor([0, 0]))
        >>> h.shape   # (2, T, D): one row per strength
    """

    def __init__(self, steered, split=True):
        call = boundary(steered.backbone) if split else None
        self.lower = None if call is None else with_cache(_cut(steered.backbone, call, "lower"))
        self.upper = steered.cached if call is None else with_cache(_cut(steered.backbone, call, "upper"))
        self.device = steered.device

    @property
    def runtime_inputs(self):
        return self.upper.runtime_inputs

    def encode(self, rows, chunk=64):
        """Token-id lists -> a batch: ids, positions, mask (N, T) left-padded, lengths (N,), and the
        states at the boundary (N, T, D), computed here once, `chunk` rows a call (None without a
        boundary)."""
        ids, positions, pads = left_pad(rows, device=self.device)
        mask = torch.arange(ids.shape[1], device=self.device)[None] >= pads[:, None]
        states = None
        if self.lower is not None:
            parts = []
            for i in range(0, len(rows), chunk):
                cache = self.lower.init_cache(len(ids[i:i + chunk]), ids.shape[1])
                parts.append(self.lower(ids[i:i + chunk], positions[i:i + chunk], 0, mask[i:i + chunk], cache)[0])
            states = torch.cat(parts)
        return {"ids": ids, "positions": positions, "mask": mask, "states": states,
                "lengths": torch.tensor([len(r) for r in rows], device=self.device)}

    def final(self, batch, inputs, which):
        """Final hidden states (R, T, D) of texts `which` (R,) with per-row `inputs` {name: (R,)}."""
        ids, positions, mask = (batch[k][which] for k in ("ids", "positions", "mask"))
        cache = self.upper.init_cache(len(which), ids.shape[1])
        token = _STATES.set(None if batch["states"] is None else batch["states"][which])
        try:
            hidden, _ = self.upper(ids, positions, 0, mask, cache, **inputs)
        finally:
            _STATES.reset(token)
        return hidden
