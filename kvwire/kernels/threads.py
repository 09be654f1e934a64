"""How many of torch's CPU threads a step should run on while other processes share the cores.

torch's OpenMP threads meet at a barrier after every op. When another process holds the core one of
them runs on, every op waits for that thread's next time slice, so a decode step of many small ops
collapses (SmolLM2 Q8_0, batch 1, 2 threads on 2 cores: 68.7 tokens/s quiet, 19.7 beside one
spinning process; on 1 thread 63.9 and 61.2: bench/threads.py, docs/performance.md). One thread
fewer than the cores that are free avoids the barrier stalls; on a quiet machine the whole pool is
faster. `Threads` decides before each engine step from what the machine did since its last reading
(`CpuUse`: Linux's /proc/stat less this process's own time), so it follows load that comes and goes.

The pool is never grown past the size it had when the engine started (a caller's
`torch.set_num_threads(1)` stays 1), and a thread count fixed by `--threads` or `KVWIRE_THREADS`
(`pin`) turns adaptation off. Off Linux (no /proc), nothing changes.
"""
import math
import os
import time
from contextlib import contextmanager

import torch

DROP_AT = 0.4  # a core other processes keep this busy is taken (a spinner beside 2 threads: ~0.67)
FREE_BELOW = 0.2  # ...and free again only below this (a band, so the count does not flap)
SHORTEST = 0.05  # seconds: a shorter window holds too few clock ticks (10 ms each) to read

_pinned = None  # the thread count a command fixed (`pin`), else None


def pin(n):
    """Fix torch's pool at `n` threads for this process (a command's --threads / KVWIRE_THREADS):
    engines then keep it, whatever else runs on the machine."""
    global _pinned
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads={n!r}; expected a positive int (threads of torch's CPU pool)")
    torch.set_num_threads(n)
    _pinned = n


def pinned():
    """The thread count `pin` fixed, or None."""
    return _pinned


class CpuUse:
    """Cores that other processes kept busy between two readings, on the CPUs this process may run on.

    Busy time per CPU comes from /proc/stat (user + nice + system + irq + softirq + steal: steal is
    time the hypervisor gave to other machines, lost to us too); this process's own from
    /proc/self/stat (utime + stime, all its threads). `read()` returns None on the first call, while
    the window is shorter than 50 ms (it then goes on) and where the files are missing or unreadable.

    Example:
        >>> use = CpuUse()
        >>> use.read() is None   # the first reading starts the window
        True
        >>> others = use.read()  # cores busy with other processes since, e.g. 0.02 or 1.0
    """

    def __init__(self, stat="/proc/stat", self_stat="/proc/self/stat", cpus=None, clock=time.monotonic):
        self.stat, self.self_stat, self.clock = stat, self_stat, clock
        self.cpus = set(os.sched_getaffinity(0)) if cpus is None and hasattr(os, "sched_getaffinity") else cpus
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = None

    def read(self):
        try:
            now = (self.clock(), self._busy(), self._own())
        except (OSError, ValueError, IndexError):
            return None
        if self.last is not None and now[0] - self.last[0] < SHORTEST:
            return None  # too short to tell: the window goes on
        last, self.last = self.last, now
        if last is None:
            return None
        others = ((now[1] - last[1]) - (now[2] - last[2])) / self.hz / (now[0] - last[0])
        return max(0.0, others)

    def _busy(self):
        """Busy clock ticks of the CPUs in `cpus` (every CPU's while None) since boot."""
        total = 0
        with open(self.stat) as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if self.cpus is not None and int(name[3:]) not in self.cpus:
                    continue
                user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
                total += user + nice + system + irq + softirq + steal
        return total

    def _own(self):
        with open(self.self_stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class Threads:
    """torch's thread count for each step: the pool's size on a quiet machine, one fewer for every
    core other processes keep busy (at least one).

    Args:
        most: the largest count (default: torch's pool size now).
        every: seconds between readings of the machine's load (a reading costs ~50 us).
        use: a `CpuUse` (or any object whose `read()` gives other processes' busy cores or None).
        clock: the clock `every` is measured on. cpu: this process's CPU seconds (all threads).

    `for_step()` gives the count to run the next step on; `engine.Engine` sets the pool to it around
    each step and calls `stepped()` after it. A window the engine sat idle for most of (between
    requests, while another program ran and stopped; or before its first step) tells what the
    machine did then, not what the next steps meet: it is restarted, and the count decided on a
    fresh window: at the end of the step that follows where that step lasted `SHORTEST` seconds
    (a call of one long step, such as a whole prompt, is then judged on itself), else at a step
    `SHORTEST` seconds later. A pause in which this process worked (a caller busy
    between streamed steps) is not idle, and a window is never restarted twice without a reading
    between (a caller pausing at every step still gets decisions). `changes` counts how often the
    count changed.

    Example:
        >>> threads = Threads()
        >>> with pool(threads.for_step()):
        ...     logits = step(ids)
        >>> threads.stepped()
    """

    def __init__(self, most=None, every=0.5, use=None, clock=time.monotonic, cpu=time.process_time):
        self.most = torch.get_num_threads() if most is None else most
        if isinstance(self.most, bool) or not isinstance(self.most, int) or self.most < 1:
            raise ValueError(f"most={most!r}; expected a positive int (threads of torch's CPU pool)")
        self.every, self.clock, self.cpu = every, clock, cpu
        self.use = CpuUse() if use is None else use
        self.cores = len(getattr(self.use, "cpus", None) or ()) or os.cpu_count() or 1
        self.n, self.others, self.changes = self.most, None, 0
        self.window_at = self.next_read = clock()  # when the window being read began
        self.stepped_at = self.stepped_cpu = None  # when the last step ended, and this process's CPU then
        self.first, self.restarted = True, False
        self.use.read()  # starts the first window

    def for_step(self):
        now = self.clock()
        if self._paused(now):
            self.use.read()  # restart the window: the count is decided on a fresh one shortly
            self.window_at, self.next_read, self.restarted = now, now + SHORTEST, True
        elif now >= self.next_read:
            others = self.use.read()
            if others is not None:  # else the window was too short: read again next step
                self.window_at, self.next_read, self.others, self.restarted = now, now + self.every, others, False
                self._decide(others)
        self.first = False
        return self.n

    def stepped(self):
        """Mark the end of a step (what `for_step` measures a pause from). A window restarted just
        before this step is read now, at its end: it then holds this process's own step and none of
        the pause that may follow (another program running while this one waits for its next call,
        which a reading at the next step would count as load on the steps to come)."""
        now = self.clock()
        self.stepped_at, self.stepped_cpu = now, self.cpu()
        if self.restarted and now - self.window_at >= SHORTEST:
            others = self.use.read()
            if others is not None:
                self.window_at, self.next_read, self.others, self.restarted = now, now + self.every, others, False
                self._decide(others)

    def _paused(self, now):
        """Whether the window since its start is mostly a pause of this process's steps: the wait
        before the first step, or the time since the last one, idle (this process used under half a
        core meanwhile) and longer than half the window."""
        if self.restarted:
            return False
        if self.stepped_at is None:
            return self.first and now - self.window_at > self.every
        gap = now - self.stepped_at
        return gap > max(SHORTEST, (now - self.window_at) / 2) and self.cpu() - self.stepped_cpu < gap / 2

    def _decide(self, others):
        down = self._fit(math.ceil(others - DROP_AT))
        up = self._fit(math.ceil(others - FREE_BELOW))
        n = down if down < self.n else up if up > self.n else self.n
        self.changes += n != self.n
        self.n = n

    def _fit(self, taken):
        return max(1, min(self.most, self.cores - max(0, taken)))


_shared = {}  # {most: Threads}: what the machine did is known across engines (`generate` makes one a call)


def adaptive(force=False):
    """The `Threads` an engine follows: None where a command pinned the pool (unless `force`) or where
    the pool has one thread (nothing to drop), else the process's one bounded by the pool's size now."""
    most = torch.get_num_threads()
    if (_pinned is not None and not force) or most <= 1:
        return None
    if most not in _shared:
        _shared[most] = Threads(most=most)
    return _shared[most]


@contextmanager
def pool(n):
    """torch's CPU pool at n threads inside (None: as it is), its size before, after."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
