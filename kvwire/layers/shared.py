"""Helpers computed once per cached-graph call and shared by every layer that asks.

Each cached attention layer needs masks for its cache and rotary tables for its positions, and
most layers ask for exactly the same ones (same positions, same window). Built per layer they cost
thousands of small ops per decode step and, traced, ~18 copies of the same nodes in an exported
graph. Inside `per_call()`, `shared(fn, *args)` computes `fn(*args)` once for equal arguments
(tensors compared by identity) and hands every later caller the same result, so a traced graph
holds one copy. Outside it (a layer called plainly) `shared` just calls `fn`: the scope changes
speed, never results, as long as `fn` is pure.
"""
import contextvars
from contextlib import contextmanager

import torch

_memo = contextvars.ContextVar("kvwire_shared", default=None)


@contextmanager
def per_call():
    """Scope of one cached-graph call: results of `shared` live until it exits."""
    token = _memo.set({})
    try:
        yield
    finally:
        _memo.reset(token)


def shared(fn, *args, key=None):
    """fn(*args), computed once per `per_call` scope for the same fn and arguments.

    Tensor arguments count as equal only when they are the same object; the memo keeps them alive,
    so an id can never be reused by another tensor inside the scope. `key` (hashable) stands in for
    `fn` when different callables compute the same thing, e.g. the bound methods of equal modules.

    Example:
        >>> with per_call():
        ...     a = shared(slot_mask, cache_index, 1, 511, 512, attention_mask)
        ...     b = shared(slot_mask, cache_index, 1, 511, 512, attention_mask)
        >>> a is b
        True
    """
    # torch.compile's tracer cannot read a ContextVar, and Inductor fuses the copies anyway; the
    # (non-strict) export tracer runs this Python as is, so exported graphs keep one copy
    if torch.compiler.is_dynamo_compiling():
        return fn(*args)
    memo = _memo.get()
    if memo is None:
        return fn(*args)
    key = (fn if key is None else key, *map(_key, args))
    if key not in memo:
        memo[key] = (fn(*args), args)
    return memo[key][0]


def _key(arg):
    if isinstance(arg, torch.Tensor):
        return id(arg), "tensor"
    if isinstance(arg, torch.SymInt):  # a dynamic size while exporting: equal when its symbol is
        return arg.node.expr, "symint"
    return arg
