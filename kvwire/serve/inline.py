"""Vectors a request carries inline: a bank of K slots in the served graph, lent to requests.

The served model holds, after every block the bank covers, one `SlotSteer` layer: K slots, each
a direction to add or a unit direction to project out (zero at first), and K per-row strengths
`inline0_strength` ... `inline{K-1}_strength` (0 by default). A request's inline
vector is written into a free slot's directions (no row is reading that slot then) and its rows set
that slot's strength; every other row leaves it at 0. Rows with different inline vectors thus share one batch, and the
runtime inputs stay (B,) strengths, as for named vectors. The slot is freed when the request ends.
A request asking for more vectors than the server allows gets 400; one that finds every slot
lent gets 429 with Retry-After. The prefix store keys each row on a digest of its slots' vectors.

Why a bank and not per-row direction inputs: the graph's inputs and the engine's per-row values
stay what they are (B,) numbers; the cost is one small (B, K) x (K, D) product per covered block and
step. The bank's directions are weights, so an exported graph has them
fixed: inline vectors are a server feature.

Wire format of one vector (kvwire's `steer_vectors` field): `{"directions": {"<block>": V, ...},
"strength": s, "operation": "add" | "ablate"}` where V is base64 of D little-endian float32 (4 D
bytes) or a JSON list of D numbers; "ablate" removes s times the component along V at those blocks.
"""
import base64
import binascii
import hashlib
import threading

import numpy as np
import torch

from ..graph import insert_after, numbered_blocks
from ..graph.sites import site_targets
from ..steer.schedule import Scheduled
from .errors import APIError


class SlotSteer(Scheduled):
    """K steering slots in one layer; slot k adds a direction or projects one out:
    x + s (B, K) @ directions (K, D) - ((x @ units^T) * s) @ units, s the rows' slot strengths.

    A slot holds either an added direction (its row of `units` zero) or a unit direction to ablate
    (its row of `directions` zero); both buffers are written in place by `InlineBank.acquire`.
    Runtime inputs `<name>{k}_strength` (B,) float32 for k < K (default 0), and the schedule's
    `<name>_start`/`_end`.
    """

    def __init__(self, slots, width, name="inline", device=None):
        super().__init__(name)
        self.register_buffer("directions", torch.zeros(slots, width, device=device))
        self.register_buffer("units", torch.zeros(slots, width, device=device))
        self.slots = slots

    def own_inputs(self):
        return {f"{self.name}{k}_strength": torch.float32 for k in range(self.slots)}

    def own_defaults(self, batch_size):
        return {name: torch.zeros(batch_size, device=self.directions.device) for name in self.own_inputs()}

    def act(self, x, on, inputs):
        s = torch.stack([inputs[name] for name in self.own_inputs()], dim=1)[:, None, :] * on  # (B, T, K)
        xf = x.float()
        removed = ((xf @ self.units.T) * s) @ self.units  # (B, T, D): the ablated slots' components
        return (xf + s @ self.directions - removed).to(x.dtype)


OPERATIONS = ("add", "ablate")


class InlineBank:
    """K slots of per-block directions in the served graph (see the module docstring).

    Args:
        lm: the model (its width and blocks). slots: K >= 1. blocks: block indices the slots cover
            (None: all). max_per_request: inline vectors one request may carry (<= slots).

    Example:
        >>> bank = InlineBank(lm, slots=4)
        >>> served = bank.apply(lm)             # what the engine runs
        >>> slot = bank.acquire({12: v})        # -> 0; rows set bank.inputs(slot, 1.0)
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
        self.digests = [None] * slots  # the vector a lent slot holds; None: free
        self._lock = threading.Lock()

    @property
    def slots(self):
        return len(self.digests)

    def apply(self, lm):
        """`lm` with the bank's layers (shared, not copied: a rebuilt model keeps the lent slots)
        after every covered block's output, after the steering already there."""
        depth, targets = site_targets(lm.backbone, "block_out", self.blocks)
        calls = {call: i for i, ends in targets.items() for call in ends}
        return lm.edit(insert_after(list(calls), lambda call, layer: self.layers[calls[call]]), depth=depth)

    def inputs(self, slot, strength):
        """The runtime inputs of a row steered by `slot` at `strength`."""
        return {f"inline{slot}_strength": float(strength)}

    def acquire(self, directions, operation="add"):
        """Lend a free slot holding `directions` ({block: (D,) float32 tensor}) to add or to ablate;
        returns its index. Raises APIError 429 when every slot is lent."""
        digest = operation + ":" + _digest(directions)
        with self._lock:
            free = next((k for k, d in enumerate(self.digests) if d is None), None)
            if free is None:
                raise APIError(f"all {self.slots} inline steering slots are in use; retry shortly",
                               param="steer_vectors", code="inline_slots_busy", status=429,
                               headers={"Retry-After": "1"})
            self.digests[free] = digest
        for i, layer in self.layers.items():  # no row reads this slot until its rows are placed
            d = directions.get(i, torch.zeros(self.width)).to(layer.directions)
            unit = d / d.norm() if operation == "ablate" and d.any() else torch.zeros_like(d)
            layer.directions[free].copy_(d if operation == "add" else torch.zeros_like(d))
            layer.units[free].copy_(unit)
        return free

    def digest(self, slot):
        """What the slot holds (the prefix store keys rows on it)."""
        return self.digests[slot]

    def release(self, slots):
        with self._lock:
            for k in slots:
                self.digests[k] = None

    def parse(self, vectors):
        """A request's `steer_vectors` (list of {"directions": {block: base64 | list}, "strength": s,
        "operation": "add" | "ablate"}) -> [({block: tensor}, strength, operation)], checked;
        APIError 400 naming what is wrong."""
        if not vectors:
            return []
        if len(vectors) > self.max_per_request:
            raise _bad(f"steer_vectors has {len(vectors)} vectors; this server allows at most "
                       f"{self.max_per_request} per request")
        out = []
        for n, item in enumerate(vectors):
            where = f"steer_vectors[{n}]"
            if not item.directions:
                raise _bad(f"{where}.directions is empty; expected {{block: vector}} for blocks {self._covered()}")
            directions = {}
            for key, value in item.directions.items():
                block = int(key) if str(key).lstrip("-").isdigit() else None
                if block not in self.blocks:
                    raise _bad(f"{where}.directions has block {key!r}; inline vectors may steer blocks "
                               f"{self._covered()}")
                directions[block] = self._vector(value, f"{where}.directions.{key}")
            if not np.isfinite(item.strength):
                raise _bad(f"{where}.strength is {item.strength}; expected a finite number")
            if item.operation not in OPERATIONS:
                raise _bad(f"{where}.operation is {item.operation!r}; expected one of {list(OPERATIONS)}")
            zero = [key for key, d in directions.items() if not d.any()]
            if item.operation == "ablate" and zero:
                raise _bad(f"{where}.directions.{zero[0]} is all zeros: it has no direction to ablate")
            out.append((directions, float(item.strength), item.operation))
        return out

    def _vector(self, value, where):
        if isinstance(value, str):
            try:
                raw = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise _bad(f"{where} is not valid base64") from None
            if len(raw) != 4 * self.width:
                raise _bad(f"{where} decodes to {len(raw)} bytes; expected {4 * self.width} "
                           f"({self.width} little-endian float32)")
            array = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        else:
            array = np.asarray(value, dtype=np.float64)
            if array.shape != (self.width,):
                raise _bad(f"{where} has {array.size} numbers; expected {self.width} (the model's width)")
        if not np.isfinite(array).all():
            raise _bad(f"{where} holds NaN or infinite values")
        return torch.from_numpy(array.astype(np.float32))

    def _covered(self):
        lo, hi = self.blocks[0], self.blocks[-1]
        return f"{lo}-{hi}" if self.blocks == list(range(lo, hi + 1)) else str(self.blocks)


def _digest(directions):
    h = hashlib.sha256()
    for i in sorted(directions):
        h.update(str(i).encode())
        h.update(directions[i].numpy().tobytes())
    return h.hexdigest()[:32]


def _bad(message):
    return APIError(message, param="steer_vectors", code="invalid_value")
