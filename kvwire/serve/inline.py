"""Vectors a request carries inline: a bank of K slots in the served graph, lent to requests.

The served model holds, after every block the bank covers, one `SlotSteer` layer: K slots, each
a direction to add, a unit direction to project out, or a unit direction whose projection is held
in [lo, hi] (zero at first), and per slot k three per-row inputs: `inline{k}_strength` (0 by
default) and `inline{k}_lo`, `inline{k}_hi` (unbounded by default). A request's inline vector is
written into a free slot (no row is reading that slot then) and its rows set that slot's strength
(add, ablate) or bounds (clamp); every other row leaves them at their inert defaults. Rows with
different inline vectors and operations thus share one batch, and the runtime inputs stay (B,)
numbers, as for named vectors. Requests sending the same vector (and operation and bounds) share
its slot, each row with its own strength; the slot is freed when the last of them ends. A request asking for more
vectors than the server allows gets 400; one that finds every slot lent gets 429 with
Retry-After. The prefix store keys each row on a digest of its slots' vectors, operations and
bounds.

Why a bank and not per-row direction inputs: the graph's inputs and the engine's per-row values
stay what they are, (B,) numbers; the cost is two small (B, T, K) x (K, D) products per covered
block and step while any slot is lent (eager steps skip the layers while none is; compiled and
exported steps always compute them). The bank's directions are weights, so an exported graph has
them fixed (and inert): inline vectors are a server feature.

Several inline vectors at one block act on the same hidden state (side by side, not one after
another); that equals applying them in turn when their directions are orthogonal. The wire
format is read by `kvwire.serve.inline_wire`.
"""
import hashlib
import threading

import torch

from ..graph import insert_after, numbered_blocks
from ..graph.sites import site_targets
from ..kernels.tracing import is_exporting
from ..layers.shared import shared
from ..steer.ops import LIMIT
from ..steer.schedule import Scheduled
from .errors import APIError
from .inline_wire import OPERATIONS, Inline, parse_vectors

__all__ = ["OPERATIONS", "Inline", "InlineBank", "SlotSteer"]


class SlotSteer(Scheduled):
    """K steering slots in one layer; slot k adds a direction, projects one out or clamps the
    projection on one:

        p = x @ units^T                                                   (B, T, K)
        x + s @ directions + ((clip(p, lo, hi) - p) * on - p * s) @ units

    with s (B, T, K) the rows' slot strengths at the scheduled positions and lo, hi (B, 1, K) their
    bounds. An added slot's row of `units` is zero; an ablated or clamped slot's row of
    `directions` is zero. A row's strength 0 and bounds +-float32 max leave a slot inert. Both
    buffers are written in place by `InlineBank.acquire`.

    Runtime inputs, (B,) float32 for k < K: `<name>{k}_strength` (default 0), `<name>{k}_lo`
    (default -float32 max), `<name>{k}_hi` (default float32 max); and the schedule's
    `<name>_start`/`_end`.
    """

    def __init__(self, slots, width, name="inline", device=None):
        super().__init__(name)
        self.register_buffer("directions", torch.zeros(slots, width, device=device))
        self.register_buffer("units", torch.zeros(slots, width, device=device))
        self.slots = slots
        self.idle = False  # True while no slot is lent (`InlineBank` keeps it)

    def forward_cached(self, x, gate=None, *, positions, **inputs):
        # while no slot is lent the rows that count read inert defaults and the layer is the identity
        # (x + 0, projections clipped to themselves): eager calls skip its products, ~8% of a
        # one-client decode step on SmolLM2; traced graphs keep them, their inputs decide (the
        # tracing checks first: dynamo would otherwise guard on `idle` and compile twice)
        if not (isinstance(x, torch.fx.Proxy) or torch.compiler.is_compiling() or torch.jit.is_tracing()
                or is_exporting()) and self.idle:
            return x
        return super().forward_cached(x, gate, positions=positions, **inputs)

    def own_inputs(self):
        return {f"{self.name}{k}_{what}": torch.float32 for k in range(self.slots) for what in ("strength", "lo", "hi")}

    def own_defaults(self, batch_size):
        names, device = self.own_inputs(), self._buffers["directions"].device
        if isinstance(batch_size, int):
            # a real call: rows of one tensor, each memory of its own (a row written in place leaves
            # the others) starting 64 bytes apart (aligned as an allocation is, for compiled steps);
            # 3K tensors made one by one cost a request ~2 ms
            values = torch.empty(self.slots, 3, -(-batch_size // 16) * 16 or 16, device=device)
            values[:, 0], values[:, 1], values[:, 2] = 0.0, -LIMIT, LIMIT
            return dict(zip(names, values.view(3 * self.slots, -1)[:, :batch_size].unbind(0)))
        fill = {"strength": 0.0, "lo": -LIMIT, "hi": LIMIT}  # traced: a batch size the trace gives
        return {name: torch.full((batch_size,), fill[name.rsplit("_", 1)[1]], device=device) for name in names}

    def act(self, x, on, inputs):
        def given(what):  # (B, 1, K): one input of every slot, stacked once per call for every block's layer
            return shared(_side_by_side, *[inputs[f"{self.name}{k}_{what}"] for k in range(self.slots)])

        s = shared(torch.mul, given("strength"), on)  # (B, T, K)
        xf = x.float()
        p = xf @ self.units.T  # (B, T, K): projections on the ablated and clamped slots' units
        change = (torch.minimum(torch.maximum(p, given("lo")), given("hi")) - p) * on - p * s
        return (xf + s @ self.directions + change @ self.units).to(x.dtype)


def _side_by_side(*values):
    """(B,) values of K slots -> (B, 1, K)."""
    return torch.stack(values, dim=1)[:, None, :]


class InlineBank:
    """K slots of per-block directions in the served graph (see the module docstring).

    Args:
        lm: the model (its width and blocks). slots: K >= 1. blocks: block indices the slots cover
            (None: all). max_per_request: inline vectors one request may carry (<= slots).

    Example:
        >>> bank = InlineBank(lm, slots=4)
        >>> served = bank.apply(lm)                    # what the engine runs
        >>> item = Inline({12: v}, "clamp", lo=-1.0, hi=1.0)
        >>> slot = bank.acquire(item)                  # -> 0; rows set bank.inputs(slot, item)
        >>> bank.release([slot])
    """

    def __init__(self, lm, slots=4, blocks=None, max_per_request=2):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"inline slots must be a positive int, got {slots!r}")
        have = numbered_blocks(lm.backbone)
        self.blocks = sorted(have) if blocks is None else sorted(blocks)
        missing = [i for i in self.blocks if i not in have]
        if missing:
            raise ValueError(f"inline blocks {missing} are not blocks of this model ({len(have)} blocks)")
        self.width = lm.head.weight.shape[1]
        self.max_per_request = min(int(max_per_request), slots)
        self.layers = {i: SlotSteer(slots, self.width, device=lm.device) for i in self.blocks}
        self.digests = [None] * slots  # what a lent slot holds; None: free
        self.users = [0] * slots  # requests a lent slot is lent to (those sending the same vector share it)
        # what each slot held when last lent and when it was given back: a vector sent again takes
        # the slot it had, so its rows' runtime inputs (and prefix-store keys) are the same again
        self.held, self.freed = [None] * slots, [0] * slots
        self._released = 0
        self._lock = threading.Lock()
        self._mark_idle()

    @property
    def slots(self):
        return len(self.digests)

    def apply(self, lm):
        """`lm` with the bank's layers (shared, not copied: a rebuilt model keeps the lent slots)
        after every covered block's output, after the steering already there."""
        depth, targets = site_targets(lm.backbone, "block_out", self.blocks)
        calls = {call: i for i, ends in targets.items() for call in ends}
        return lm.edit(insert_after(list(calls), lambda call, layer: self.layers[calls[call]]), depth=depth)

    def inputs(self, slot, item):
        """The runtime inputs of a row steered by `item` (an `Inline`) in `slot`."""
        if item.operation == "clamp":
            return {f"inline{slot}_lo": -LIMIT if item.lo is None else item.lo,
                    f"inline{slot}_hi": LIMIT if item.hi is None else item.hi}
        return {f"inline{slot}_strength": float(item.strength)}

    def acquire(self, item, taken=()):
        """Lend a slot holding `item` (an `Inline`: {block: (D,) float32 tensor} and its operation):
        one already lent with the same vector, operation and bounds (shared: its rows set their own
        strengths), else a free one; returns its index. `taken`: slots the same request holds (a
        request sending one vector twice gets two slots, whose strengths add). Raises APIError 429
        when every slot is lent."""
        digest = f"{item.operation}:{item.lo}:{item.hi}:{_digest(item.directions)}"
        with self._lock:
            same = next((k for k, d in enumerate(self.digests) if d == digest and k not in taken), None)
            if same is not None:
                self.users[same] += 1
                return same
            free = [k for k, d in enumerate(self.digests) if d is None]
            if not free:
                raise APIError(f"all {self.slots} inline steering slots are in use; retry shortly",
                               param="steer_vectors", code="inline_slots_busy", status=429,
                               headers={"Retry-After": "1"})
            # the slot this vector had, else the one given back longest ago (others keep theirs)
            free = min(free, key=lambda k: (self.held[k] != digest, self.freed[k]))
            self.digests[free], self.users[free] = digest, 1
            self._mark_idle()
            if self.held[free] == digest:
                return free  # its directions are still there
            self.held[free] = digest
        for i, layer in self.layers.items():  # no row reads this slot until its rows are placed
            d = item.directions.get(i, torch.zeros(self.width)).to(layer.directions)
            added = item.operation == "add"
            layer.directions[free].copy_(d if added else torch.zeros_like(d))
            layer.units[free].copy_(d / d.norm() if not added and d.any() else torch.zeros_like(d))
        return free

    def digest(self, slot):
        """What the slot holds (the prefix store keys rows on it)."""
        return self.digests[slot]

    def release(self, slots):
        with self._lock:
            for k in slots:
                self.users[k] -= 1
                if self.users[k] == 0:
                    self.digests[k] = None
                    self._released += 1
                    self.freed[k] = self._released
            self._mark_idle()

    def _mark_idle(self):
        """Tell the layers whether any slot is lent (under the lock). A slot is given back when its
        request ends or its client leaves; a cancelled row the engine has not dropped yet may still
        run a step on it, and the engine keeps no prefix of a cancelled sequence."""
        idle = all(d is None for d in self.digests)
        for layer in self.layers.values():
            layer.idle = idle

    def parse(self, vectors):
        """A request's `steer_vectors` -> [Inline], checked (`kvwire.serve.inline_wire`); APIError
        400 naming what is wrong."""
        return parse_vectors(vectors, self.blocks, self.width, self.max_per_request)


def _digest(directions):
    h = hashlib.sha256()
    for i in sorted(directions):
        h.update(str(i).encode())
        h.update(directions[i].numpy().tobytes())
    return h.hexdigest()[:32]
