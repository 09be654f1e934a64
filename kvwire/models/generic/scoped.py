"""What a generic model's call hands its wrapped transformers modules (the running step, the
layer's recorded arguments, the state plan), in per-thread variables dynamo can trace.

A `contextvars.ContextVar` would do the same, but dynamo stops its graph at every `get` and `set`:
under `lm.compile(ahead=False)` a two-layer RecurrentGemma's prompt and decode steps compiled as 44
graphs, each a compile of its own with Python between them. Attributes of a `threading.local` it
reads and writes inside one graph. Each thread sees its own values (the engine runs a model on one
thread at a time), as with a ContextVar outside asyncio.
"""
import threading


class Scoped(threading.local):
    """A per-thread value with ContextVar's `get`, `set` (returns a token) and `reset(token)`.

    Example:
        >>> running = Scoped(None)
        >>> token = running.set(step)
        >>> running.get() is step
        True
        >>> running.reset(token)  # back to what it was before the set
    """

    def __init__(self, default=None):  # threading.local runs it again, with these arguments, on each thread
        self.value = default

    def get(self):
        return self.value

    def set(self, value):
        token, self.value = self.value, value
        return token

    def reset(self, token):
        self.value = token
