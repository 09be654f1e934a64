"""The wire format of vectors a request carries inline (kvwire's `steer_vectors` field), read
into `Inline` records for `kvwire.serve.inline.InlineBank`.

One vector: `{"directions": {"<block>": V, ...}, "operation": "add" | "ablate" | "clamp",
"strength": s, "lo": a, "hi": b}` where V is base64 of D little-endian float32 (4 D bytes) or a
JSON list of D numbers.

- "add" (the default): adds s V at those blocks (s defaults to 1);
- "ablate": removes s times the component along V (s = 1 removes it all);
- "clamp": holds the projection on the unit direction u = V / |V| in [a, b]:
  x + (clip(x.u, a, b) - x.u) u (`kvwire.steer.Clamp`); lo or hi left out is unbounded on that
  side; a clamp takes no strength, and "lo"/"hi" belong to clamps only.

Every mistake is an APIError 400 on `steer_vectors` naming the vector, what was received and what
was expected.
"""
import base64
import binascii
import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import APIError

OPERATIONS = ("add", "ablate", "clamp")


@dataclass(frozen=True)
class Inline:
    """One inline vector, checked: directions {block: (D,) float32 tensor}, its operation, the
    strength of "add"/"ablate" and the bounds of "clamp" (None: unbounded)."""

    directions: dict
    operation: str = "add"
    strength: float = 1.0
    lo: float = None
    hi: float = None


def parse_vectors(vectors, blocks, width, max_per_request):
    """A request's `steer_vectors` (a list of `InlineVector`) -> [Inline]; APIError 400 naming
    what is wrong. `blocks`: the block indices the bank covers; `width`: D."""
    if not vectors:
        return []
    if len(vectors) > max_per_request:
        raise _bad(f"steer_vectors has {len(vectors)} vectors; this server allows at most "
                   f"{max_per_request} per request")
    return [_one(item, f"steer_vectors[{n}]", blocks, width) for n, item in enumerate(vectors)]


def _one(item, where, blocks, width):
    covered = _covered(blocks)
    if not item.directions:
        raise _bad(f"{where}.directions is empty; expected {{block: vector}} for blocks {covered}")
    directions = {}
    for key, value in item.directions.items():
        block = int(key) if str(key).lstrip("-").isascii() and str(key).lstrip("-").isdecimal() else None
        if block not in blocks:
            raise _bad(f"{where}.directions has block {key!r}; inline vectors may steer blocks {covered}")
        directions[block] = decode_direction(value, f"{where}.directions.{key}", width)
    if item.operation not in OPERATIONS:
        raise _bad(f"{where}.operation is {item.operation!r}; expected one of {list(OPERATIONS)}")
    if item.strength is not None and not math.isfinite(item.strength):
        raise _bad(f"{where}.strength is {item.strength}; expected a finite number")
    for side in ("lo", "hi"):
        value = getattr(item, side)
        if value is not None and not math.isfinite(value):
            raise _bad(f"{where}.{side} is {value}; expected a finite number (leave it out for no bound)")
    zero = [key for key, d in directions.items() if not d.any()]
    if item.operation != "add" and zero:
        raise _bad(f"{where}.directions.{zero[0]} is all zeros: it has no direction to {item.operation}")
    if item.operation == "clamp":
        if item.strength is not None:
            raise _bad(f"{where}.strength is {item.strength}, but a clamp takes no strength; its lo and hi "
                       f"bound the projection on the direction")
        if item.lo is not None and item.hi is not None and item.lo > item.hi:
            raise _bad(f"{where}: lo {item.lo} > hi {item.hi}; expected lo <= hi")
        return Inline(directions, "clamp", lo=_float(item.lo), hi=_float(item.hi))
    given = [side for side in ("lo", "hi") if getattr(item, side) is not None]
    if given:
        raise _bad(f"{where}.{given[0]} is {getattr(item, given[0])}, but {given[0]} applies to operation 'clamp' "
                   f"only; this vector's operation is {item.operation!r}")
    return Inline(directions, item.operation, 1.0 if item.strength is None else float(item.strength))


def decode_direction(value, where, width, bad=None):
    """A direction as the wire carries it -> (width,) float32: base64 of `width` little-endian
    float32, or a list of `width` numbers. NaN, infinities and numbers past float32's range are
    refused; `bad(message)` makes the error (default: one naming `steer_vectors`)."""
    bad = _bad if bad is None else bad
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{where} is not valid base64") from None
        if len(raw) != 4 * width:
            raise bad(f"{where} decodes to {len(raw)} bytes; expected {4 * width} ({width} little-endian float32)")
        array = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    else:
        array = np.asarray(value, dtype=np.float64)
        if array.shape != (width,):
            raise bad(f"{where} has {array.size} numbers; expected {width} (the model's width)")
        with np.errstate(over="ignore"):  # a number past float32's range becomes inf: refused below
            array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise bad(f"{where} holds NaN, infinite or past-float32 values")
    return torch.from_numpy(array)


def _float(value):
    return None if value is None else float(value)


def _covered(blocks):
    lo, hi = blocks[0], blocks[-1]
    return f"{lo}-{hi}" if list(blocks) == list(range(lo, hi + 1)) else str(list(blocks))


def _bad(message):
    return APIError(message, param="steer_vectors", code="invalid_value")
