"""Memory planned at start-up: what `max_batch` x `max_length` rows of keys/values cost, against what
this process may still take (the machine's MemAvailable and its cgroup's limit), so a flag can no
longer make the first request grow the server until the kernel kills it.

Explicit flags that cannot fit are refused; defaults that cannot are lowered, with a log line.
The engine still grows its rows' timeline with the sequences (`Engine(grow=True)`), so this is the
worst case it may reach under full load, not what it takes at start.
"""
import logging
import math
from pathlib import Path

from ..graph.cache import CACHE_DTYPE

log = logging.getLogger("kvwire.serve")

SHARE = 0.8  # of the memory available at start-up, what caches may take (activations, buffers: the rest)
FLOOR = 256  # defaults are not lowered below this many positions a row


def cache_bytes(graph, batch, length):
    """Bytes of `graph.init_cache(batch, length)` (keys and values of every cached layer), not
    allocated."""
    return sum(slot_bytes(slot, batch, length) for slot in graph.slots)


def slot_bytes(slot, batch, length):
    """Bytes of one cache slot (a `CacheSlot`) for `batch` rows of `length` positions."""
    return sum(math.prod(shape) for shape in slot.module.cache_spec(batch, length, CACHE_DTYPE) or ()) \
        * CACHE_DTYPE.itemsize


def available_bytes(root=Path("/")):
    """(bytes this process may still allocate, where that figure comes from): the smallest of
    /proc/meminfo's MemAvailable and the room left under its cgroup's limit (v2 memory.max, v1
    memory.limit_in_bytes). (None, reason) when none can be read."""
    found = []
    meminfo = _read(root / "proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    for limit, usage, name in _cgroup_files(root):
        cap, used = _number(_read(limit)), _number(_read(usage))
        if cap is not None and used is not None and cap < 1 << 60:  # "max" / the v1 no-limit value
            found.append((max(0, cap - used), f"the cgroup's {name} ({_gib(cap)} limit)"))
    return min(found) if found else (None, "no /proc/meminfo or cgroup memory files")


def plan(graph, max_batch, max_length, *, batch_given, length_given, budget=None, reserved=0):
    """(max_batch, max_length) whose caches, plus `reserved` bytes (the prefix store), fit the budget.

    Args:
        graph: the served model's cached graph (its `slots` give the cache shapes).
        batch_given / length_given: whether the values came from flags (refused when they cannot
            fit) or defaults (max_length halved, down to 256, then max_batch, until they fit).
        budget: bytes the caches may take; default SHARE of `available_bytes()`.

    Example:
        >>> plan(lm.cached, 8, 100_000, batch_given=False, length_given=True, budget=8 << 30)
        ValueError: --max-batch 8 x --max-length 100000 needs 18.3 GiB of keys and values; ...
    """
    if budget is None:
        free, source = available_bytes()
        if free is None:
            log.warning("kvwire serve: cannot read the memory available (%s); caches are not planned", source)
            return max_batch, max_length
        budget, source = int(free * SHARE), f"{int(SHARE * 100)}% of {_gib(free)} ({source})"
    else:
        source = "the memory budget given"
    room = budget - reserved

    def need(b, n):
        return cache_bytes(graph, b, n)

    if need(max_batch, max_length) <= room:
        return max_batch, max_length
    wanted = (max_batch, max_length)
    batch, length = max_batch, max_length
    while need(batch, length) > room and not length_given and length // 2 >= FLOOR:
        length //= 2
    while need(batch, length) > room and not batch_given and batch > 1:
        batch //= 2
    if need(batch, length) > room:
        flags = " x ".join(f"--{name} {value}" + ("" if given else " (default)") for name, value, given in
                           (("max-batch", max_batch, batch_given), ("max-length", max_length, length_given)))
        raise ValueError(f"{flags} needs {_gib(need(*wanted))} of keys and values"
                         + (f" (plus {_gib(reserved)} for the prefix store)" if reserved else "")
                         + f"; this server may use {_gib(budget)}: {source}. Expected a smaller --max-batch or "
                         f"--max-length (one row of {max_length} positions takes {_gib(need(1, max_length))})")
    log.warning("kvwire serve: max_batch %d -> %d, max_length %d -> %d so the caches (%s) fit %s (%s)",
                max_batch, batch, max_length, length, _gib(need(batch, length)), _gib(room), source)
    return batch, length


def _cgroup_files(root):
    """(limit file, usage file, name) for this process's cgroup, v2 then v1, own path then the root."""
    own = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        own["v2" if number == "0" else controllers] = path.lstrip("/")
    base = root / "sys/fs/cgroup"
    for folder in dict.fromkeys([base / own.get("v2", ""), base]):
        if (folder / "memory.max").is_file():
            yield folder / "memory.max", folder / "memory.current", "memory.max"
            break
    v1 = base / "memory"
    for folder in dict.fromkeys([v1 / own.get("memory", ""), v1]):
        if (folder / "memory.limit_in_bytes").is_file():
            yield folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes", "memory.limit_in_bytes"
            break


def _read(path):
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _number(text):
    text = (text or "").strip()
    return int(text) if text.isascii() and text.isdecimal() else None


def _gib(n):
    return f"{n / (1 << 30):.1f} GiB"
