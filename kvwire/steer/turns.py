"""Turns between the batches of a long analysis (an evaluation, a patching sweep, a capture): the
points where a caller holding something others wait for lets them run a while.

The library's loops call `turn()` before each batch after the first; outside `taking_turns` it does
nothing. `kvwire serve` runs its analysis endpoints with the engine paused and gives the engine a
turn there (`kvwire.serve.bridge.Gate.turn`), so chat requests keep decoding while an evaluation runs.

Example:
    >>> with taking_turns(lambda: print("turn")):
    ...     result = kw.steer.evaluate(lm, vector, dataset, [0, 4])   # prints between its batches
"""
import contextvars
from contextlib import contextmanager

_turn = contextvars.ContextVar("kvwire_analysis_turn", default=None)


@contextmanager
def taking_turns(fn):
    """Inside: `turn()` calls fn() (no arguments) on this thread."""
    token = _turn.set(fn)
    try:
        yield
    finally:
        _turn.reset(token)


def turn():
    """Between two batches of a long loop: the current `taking_turns` function, if any."""
    fn = _turn.get()
    if fn is not None:
        fn()
