"""The engine's thread and asyncio: one thread runs `engine.serve_forever`; each request's
sequences report new tokens into that request's asyncio.Queue through `loop.call_soon_threadsafe`.

`gate` keeps model work off the engine thread (training a vector, building a steered model, a
sweep) from overlapping an engine step: torch.fx patches `nn.Module.__call__` process-wide while it
traces, so a forward on another thread during a trace breaks both. Such work waits for the step
that is running, and the engine waits for it (generation pauses while a vector trains).

`swap(engine)` replaces the served engine (a model with one more control vector) by draining: new
requests go to the new engine at once and wait in its queue, the thread finishes what the old
engine is running, then serves the new one. A running sequence never changes model mid-stream.

Operators' bounds live here too, where a request's sequences enter and leave: `max_waiting` (a
request that finds the queue full gets 429) and `request_seconds` (a request past it is cancelled,
504); and a `metrics` object, if any, hears of each request's sequences once they are over.
"""
import asyncio
import logging
import threading
import time
from contextlib import contextmanager

from ..generate.request import RequestError
from .errors import APIError, from_request_error
from .limits import FLAGS

log = logging.getLogger("kvwire.serve")
_FAILED = -1  # queued to every run when the engine thread dies


class EngineThread:
    """Runs `engine.serve_forever` on a daemon thread between `start()` and `stop()`.

    Args:
        engine: the `Engine` to serve (`swap` moves on to another).
        max_waiting: sequences that may wait for a row; `run` refuses a request (429) that finds that
            many waiting. None: no bound.
        request_seconds: each request's wall time from `run`; past it `Run.updates` cancels its
            sequences and raises a 504 `APIError`. None: no bound.
        metrics: an object with `record(seqs, firsts, timed_out)` (`kvwire.serve.metrics.Metrics`),
            called on the event loop once per request when its updates end (finished, failed, timed
            out or gone); None: nothing recorded.

    Example:
        >>> bridge = EngineThread(Engine(lm, max_batch=8))
        >>> bridge.start()
        >>> run = bridge.run([dict(prompt=ids, max_new_tokens=16)])   # on the event loop
        >>> async for changed in run.updates(): ...
        >>> bridge.stop()
    """

    def __init__(self, engine, *, max_waiting=None, request_seconds=None, metrics=None):
        self.engine = engine
        self.max_waiting, self.request_seconds, self.metrics = max_waiting, request_seconds, metrics
        self.failure = None  # the exception that stopped the engine thread, if any
        self._stop, self._thread, self._runs = threading.Event(), None, set()
        self.swaps = 0  # engines the thread has moved on to
        self.gate = Gate(busy=lambda: not self.engine.idle)  # read while the engine is parked

    @property
    def waiting(self):
        """Sequences queued for a row: the engine's queue and what was submitted since its last step."""
        engine = self.engine
        return len(engine.waiting) + engine._inbox.qsize()  # both safe to read from another thread

    @property
    def alive(self):
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def start(self):
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the engine thread is already running: two threads would step one engine (an app's "
                               "lifespan entered twice?)")
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="kvwire-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout=30):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def swap(self, engine):
        """Send new requests to `engine` from now on; the thread moves to it once the current engine
        has finished its running and queued sequences. Call on the event loop (as `run`), so no
        request is checked against one engine and submitted to the other."""
        if not self.alive:
            raise APIError(f"the engine is not running ({self.failure!r})", status=503, type="server_error",
                           code="engine_stopped")
        self.engine = engine

    def _serve(self):
        try:
            engine = self.engine
            while True:
                engine.serve_forever(_Until(self._stop, lambda: self.engine is not engine and engine.idle, self.gate,
                                            engine))
                if self._stop.is_set():
                    return
                engine = self.engine
                self.swaps += 1
                log.info("serving the new model (swap %d)", self.swaps)
        except BaseException as e:  # a bug inside a step: the engine's state is unknown, so stop serving
            log.exception("the engine thread stopped")
            self.failure = e
            for run in list(self._runs):
                run.notify(_FAILED)
        finally:
            self.gate.engine_stopped()

    def run(self, requests):
        """Submit sequences (each a dict of `Engine.submit` arguments) for one HTTP request; call on
        the event loop. A `RequestError` from the engine is a 400; earlier sequences are cancelled."""
        if not self.alive:
            raise APIError(f"the engine is not running ({self.failure!r})", status=503, type="server_error",
                           code="engine_stopped")
        waiting = self.waiting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            # type "requests": what OpenAI's own rate limits say; clients read the status and Retry-After
            raise APIError(f"the server is busy: {waiting} sequences are waiting for a row, its limit "
                           f"({FLAGS['max_waiting']} {self.max_waiting}); retry shortly", code="rate_limit_exceeded",
                           status=429, type="requests", headers={"Retry-After": "1"})
        run = Run(self, asyncio.get_running_loop())
        # choices of one prompt are submitted with the same ids object: metrics count that prompt once
        run.firsts = [i for i, o in enumerate(requests)
                      if i == 0 or o.get("prompt") is not requests[i - 1].get("prompt")]
        try:
            for i, options in enumerate(requests):
                run.seqs.append(self.engine.submit(**options, listener=run.listener(i)))
        except RequestError as e:
            run.cancel()
            raise from_request_error(e) from None
        self._runs.add(run)
        return run


class Gate:
    """Engine steps on one side, `exclusive()` blocks of other threads on the other: never both.

    The engine thread calls `checkpoint()` between steps (serve_forever's stop check, so also every
    poll while idle); `exclusive()` waits for the next checkpoint and holds the engine there. A long
    holder (an analysis endpoint) calls `turn()` between its batches: where the engine has work
    (`busy()`), it then takes at least one step, and goes on stepping for as long as the holder
    held it since its last turn (at most `MAX_TURN` seconds) or until it runs out of work; then the
    holder takes it back. Both make progress: chat requests keep decoding while an evaluation runs.

    Example:
        >>> with bridge.gate.exclusive():
        ...     vector = kw.ControlVector.train(lm, positive, negative)   # traces: no step meanwhile
    """

    MAX_TURN = 1.0  # seconds the engine may step in one turn

    def __init__(self, busy=lambda: False):
        self.busy = busy
        self._cond = threading.Condition()
        self._stepping, self._waiting, self._stopped = False, 0, False
        self._owed = False  # a turn given to the engine that it has not taken yet
        self._share_until = 0.0  # monotonic time until which the engine steps though others wait
        self._held_since = 0.0
        self.holder = None  # the id of the thread inside `exclusive()`, if any

    def checkpoint(self, idle=lambda: False):
        """Between engine steps; `idle()`: whether the engine has nothing to do (a turn given to it
        then ends), asked only while a turn is on."""
        with self._cond:
            self._stepping = False
            if self._share_until and idle():
                self._owed, self._share_until = False, 0.0
            self._cond.notify_all()
            while (self.holder is not None or self._waiting) and not self._owed \
                    and time.monotonic() >= self._share_until:
                self._cond.wait()
            self._owed, self._stepping = False, True

    def engine_stopped(self):
        with self._cond:
            self._stepping, self._stopped, self._owed, self._share_until = False, True, False, 0.0
            self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._take()
        try:
            yield
        finally:
            with self._cond:
                self.holder = None
                self._cond.notify_all()

    def turn(self):
        """Inside `exclusive()`, between batches: let a busy engine step (see the class docstring),
        then hold it again. Returns at once when the engine has nothing to do."""
        with self._cond:
            if self.holder != threading.get_ident():
                raise RuntimeError("Gate.turn() is for the thread inside exclusive()")
            if self._stopped or not self.busy():
                return
            now = time.monotonic()
            self.holder, self._owed = None, True
            self._share_until = now + min(now - self._held_since, self.MAX_TURN)
            self._cond.notify_all()
            self._take()

    def _take(self):
        """Wait (the lock held) until no step runs, nobody holds the engine and any turn given to
        it is taken and over; then hold it."""
        self._waiting += 1
        try:
            while True:
                left = self._share_until - time.monotonic()
                if left <= 0 and not self._owed and not self._stepping and self.holder is None:
                    break
                self._cond.wait(timeout=left if left > 0 else None)
        finally:
            self._waiting -= 1
        self.holder, self._held_since, self._share_until = threading.get_ident(), time.monotonic(), 0.0


class _Until:
    """A stop flag for `serve_forever` (it only calls `is_set`, between steps): the server stops, or
    `drained()`; each call is also the gate's checkpoint."""

    def __init__(self, stop, drained, gate, engine):
        self.stop, self.drained, self.gate, self.engine = stop, drained, gate, engine

    def _idle(self):
        return self.engine.idle

    def is_set(self):
        self.gate.checkpoint(self._idle)
        return self.stop.is_set() or self.drained()


class Run:
    """One HTTP request's sequences and the queue their progress arrives in."""

    def __init__(self, bridge, loop):
        self.bridge, self.loop, self.seqs = bridge, loop, []
        self.queue = asyncio.Queue()
        self.firsts = None  # indices of the sequences that start a prompt (for metrics; None: each does)
        seconds = bridge.request_seconds
        self.deadline, self.timed_out = None if seconds is None else loop.time() + seconds, False

    def notify(self, index):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, index)
        except RuntimeError:  # the event loop closed (server shutting down): nobody is waiting
            pass

    def listener(self, index):
        return lambda seq: self.notify(index)

    async def updates(self, poll=0.5):
        """Yield the set of choice indices that changed (empty every `poll` seconds without news,
        so callers can check the client is still there) until every sequence is done, then all of them
        once more: every sequence is then done. Past the bridge's `request_seconds` the sequences are
        cancelled and a 504 `APIError` raised."""
        try:
            while not all(s.done for s in self.seqs):
                wait = poll if self.deadline is None else min(poll, self.deadline - self.loop.time())
                if wait <= 0:
                    self.timed_out = True
                    self.cancel()  # as for a client gone: the engine frees the rows at its next step
                    raise APIError(f"the request ran past this server's limit of {self.bridge.request_seconds:g} "
                                   f"seconds ({FLAGS['request_seconds']}); it was cancelled", status=504,
                                   type="server_error", code="timeout")
                try:
                    changed = {await asyncio.wait_for(self.queue.get(), wait)}
                except asyncio.TimeoutError:
                    changed = set()
                while not self.queue.empty():
                    changed.add(self.queue.get_nowait())
                if _FAILED in changed:
                    raise APIError(f"the engine stopped: {self.bridge.failure!r}", status=500, type="server_error",
                                   code="engine_stopped")
                yield changed
            yield set(range(len(self.seqs)))  # the final state of all (some finished after their last news)
        finally:
            self.bridge._runs.discard(self)
            if self.bridge.metrics is not None:
                self.bridge.metrics.record(self.seqs, self.firsts, self.timed_out)

    def cancel(self):
        """The client went away: free its rows (thread-safe; the engine drops them at its next step)."""
        for seq in self.seqs:
            if not seq.done:
                seq.cancel()
