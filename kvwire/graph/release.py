"""Free what torch.fx keeps of a graph module's generated code once the module itself is gone.

torch.fx compiles each `GraphModule`'s forward from generated source and keeps that source in a
module-level cache (and a `linecache` entry) for tracebacks, forever: a new `lm.steer(...)` copy of
the default model left 53 kB behind per copy (bench/long_run.py --steer-each-call), which a server
making a steered copy per request would never get back. kvwire's graph modules drop their entries
when they are collected, and when they are recompiled (the old code is unreachable then).
"""
import linecache
import weakref

from torch.fx import graph_module as _fx


def owned(gm):
    """Register `gm` so its generated source is forgotten when it is collected. Returns gm."""
    key = _source_key(gm)
    if key is not None:
        weakref.finalize(gm, _forget, key)
    return gm


def recompile(gm):
    """`gm.recompile()`, forgetting the source of the forward it replaces. Returns gm."""
    old = _source_key(gm)
    gm.recompile()
    if old is not None and old != _source_key(gm):
        _forget(old)
    return owned(gm)


def _source_key(gm):
    # fx gives every GraphModule a class of its own and puts the compiled forward on it; the
    # code's file name is the cache key ("<eval_with_key>.N")
    code = getattr(type(gm).__dict__.get("forward"), "__code__", None)
    name = getattr(code, "co_filename", "")
    return name if name.startswith("<eval_with_key>") else None


def _forget(key):
    cache = getattr(getattr(_fx, "_loader", None), "eval_cache", None)  # private: absent in other torches
    if isinstance(cache, dict):
        cache.pop(key, None)
    linecache.cache.pop(key, None)


def kept_source_bytes():
    """Bytes of generated source torch.fx holds now (bench/long_run.py reports it)."""
    cache = getattr(getattr(_fx, "_loader", None), "eval_cache", None)
    return sum(len(s) for s in cache.values()) if isinstance(cache, dict) else 0
