"""torch's thread count under other processes' load (kvwire.kernels.threads) and the engine following it."""
import os
import subprocess
import sys
import time

import pytest
import torch

import kvwire as kw
from kvwire.cli import options
from kvwire.generate.engine import Engine
from kvwire.kernels import threads
from kvwire.kernels.threads import CpuUse, Threads

from .conftest import FAMILIES


class Load:
    """A stand-in `CpuUse`: reads what the test says other processes did."""

    def __init__(self, others, cpus=(0, 1)):
        self.others, self.cpus, self.reads = others, set(cpus), 0

    def read(self):
        self.reads += 1
        return None if self.reads == 1 else self.others


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def governed(others, most=2, cpus=(0, 1), cpu=None):
    load, clock = Load(others, cpus), Clock()
    return Threads(most=most, every=0.5, use=load, clock=clock, cpu=cpu or Clock()), load, clock


def test_the_pool_on_a_quiet_machine_one_thread_beside_a_busy_core():
    quiet, _, _ = governed(0.03)
    assert quiet.for_step() == 2
    busy, _, _ = governed(0.7)  # a spinner beside two of our threads gets ~2/3 of a core
    assert busy.for_step() == 1
    assert busy.changes == 1 and busy.others == 0.7


def test_one_fewer_for_each_busy_core_never_below_one_nor_above_most():
    four, load, clock = governed(1.0, most=4, cpus=range(4))
    assert four.for_step() == 3
    load.others, clock.now = 2.5, clock.now + 1
    assert four.for_step() == 1  # 3 cores taken of 4
    load.others, clock.now = 9.0, clock.now + 1
    assert four.for_step() == 1
    load.others, clock.now = 0.0, clock.now + 1
    assert four.for_step() == 4
    capped, _, _ = governed(0.0, most=2, cpus=range(8))
    assert capped.for_step() == 2  # a pool of 2 stays 2 on an idle 8-core machine


def test_a_band_keeps_the_count_from_flapping():
    t, load, clock = governed(0.7)
    assert t.for_step() == 1
    for others, expected in [(0.3, 1), (0.39, 1), (0.1, 2), (0.3, 2), (0.39, 2), (0.45, 1)]:
        load.others, clock.now = others, clock.now + 0.6
        assert t.for_step() == expected, others


def test_readings_come_every_so_often_and_retry_after_a_short_window():
    t, load, clock = governed(0.7)
    assert t.for_step() == 1 and load.reads == 2
    clock.now += 0.2
    assert t.for_step() == 1 and load.reads == 2  # not due yet
    load.others, clock.now = None, clock.now + 0.4  # due, but the window was too short to read
    t.for_step()
    assert load.reads == 3
    t.for_step()
    assert load.reads == 4  # read again at the next step
    load.others = 0.0
    assert t.for_step() == 2


def test_load_seen_while_the_engine_was_idle_is_not_acted_on():
    # another program ran and stopped between two of our requests: the window spanning the pause
    # says nothing about the steps to come, so a fresh one decides
    t, load, clock = governed(0.0)
    assert t.for_step() == 2
    t.stepped()
    clock.now += 3.0
    load.others = 1.8  # what the machine did during the pause
    reads = load.reads
    assert t.for_step() == 2 and load.reads == reads + 1  # the window restarted, nothing decided
    clock.now += 0.02
    assert t.for_step() == 2 and load.reads == reads + 1  # the fresh window is read after SHORTEST
    load.others, clock.now = 0.0, clock.now + 0.04
    assert t.for_step() == 2 and t.changes == 0

    # a program still running after the pause is seen on the fresh window
    t.stepped()
    clock.now += 2.0
    load.others = 0.9
    assert t.for_step() == 2
    clock.now += 0.06
    assert t.for_step() == 1 and t.changes == 1

    # steps in a row read the window as before, however long each is
    clock.now += 0.6  # one long step (a big prompt chunk)
    t.stepped()
    load.others = 0.0
    assert t.for_step() == 2 and t.changes == 2


def test_a_pause_shorter_than_a_reading_interval_but_most_of_the_window_is_not_read():
    t, load, clock = governed(0.0)
    assert t.for_step() == 2  # reads: a window starts now
    clock.now += 0.05
    t.stepped()
    clock.now += 0.45  # idle for 0.45 s of the 0.5 s window, while another program ran
    load.others = 1.6
    assert t.for_step() == 2 and t.changes == 0
    load.others, clock.now = 0.0, clock.now + 0.06
    assert t.for_step() == 2 and t.changes == 0


def test_the_wait_before_the_first_step_is_not_read():
    t, load, clock = governed(1.8)  # a program that ran while the server waited for its first request
    clock.now += 600
    assert t.for_step() == 2 and t.changes == 0
    load.others, clock.now = 0.0, clock.now + 0.06
    assert t.for_step() == 2 and t.changes == 0


def test_a_pause_in_which_this_process_worked_is_read_and_a_window_restarts_once():
    cpu = Clock()
    t, load, clock = governed(0.0, cpu=cpu)
    assert t.for_step() == 2
    t.stepped()
    clock.now += 2.0
    cpu.now += 1.5  # a caller busy between streamed steps: its own work, not idle time
    load.others = 0.9
    assert t.for_step() == 1 and t.changes == 1  # read: a core taken by another process
    t.stepped()
    clock.now += 2.0  # idle now: restarted...
    load.others = 0.0
    reads = load.reads
    assert t.for_step() == 1 and load.reads == reads + 1
    t.stepped()
    clock.now += 2.0  # ...and idle again before a reading: read this time
    assert t.for_step() == 2 and load.reads == reads + 2 and t.changes == 2


def test_a_restarted_window_is_read_at_the_end_of_the_step_it_began_with():
    # one-step calls (a whole prompt, `generate(ids, 1)`) alternating with another program's runs:
    # the window restarted before a step is read when the step ends, so the other program's run in
    # the pause after it is not taken for load on the next call (it dropped a 512-token prefill to
    # one thread for its first chunk)
    cpu = Clock()
    t, load, clock = governed(0.0, cpu=cpu)
    assert t.for_step() == 2
    t.stepped()
    clock.now += 2.0  # idle: restarted before the next step
    reads = load.reads
    assert t.for_step() == 2 and load.reads == reads + 1
    clock.now += 0.5
    cpu.now += 1.0  # the step itself, on a quiet machine
    t.stepped()
    assert load.reads == reads + 2 and t.others == 0.0  # read at its end
    clock.now += 0.6  # another program runs now, this process waits
    load.others = 1.8
    assert t.for_step() == 2 and t.changes == 0  # a pause: restarted again, not read
    assert load.reads == reads + 3
    clock.now += 0.5
    cpu.now += 1.0
    load.others = 0.9  # but a program running during a step is seen at the step's end
    t.stepped()
    assert t.changes == 1 and t.for_step() == 1
    # a step shorter than a reading's window is not read at its end: the next step reads, as before
    clock.now += 2.0
    t.for_step()
    reads = load.reads
    clock.now += 0.01
    t.stepped()
    assert load.reads == reads


def stat_lines(per_cpu):
    """/proc/stat text: per_cpu {n: (user, nice, system, idle, iowait, irq, softirq, steal, guest)}."""
    total = [sum(v[i] for v in per_cpu.values()) for i in range(9)]
    rows = [("cpu", total)] + [(f"cpu{n}", v) for n, v in per_cpu.items()]
    return "".join(f"{name} {' '.join(map(str, v))} 0\n" for name, v in rows) + "intr 1 2 3\nctxt 5\n"


def self_stat(utime, stime):
    # the command name may hold spaces and parentheses: fields are read after the last ")"
    return f"4242 (python (a b)) R 1 2 3 4 5 6 7 8 9 10 {utime} {stime} 0 0 20 0 3 0 99\n"


def test_cpu_use_counts_others_busy_ticks_on_our_cpus_less_our_own(tmp_path):
    stat, own, clock = tmp_path / "stat", tmp_path / "self", Clock()
    use = CpuUse(stat, own, cpus={0, 1}, clock=clock)
    hz = use.hz
    stat.write_text(stat_lines({0: (0,) * 9, 1: (0,) * 9, 2: (0,) * 9}))
    own.write_text(self_stat(0, 0))
    assert use.read() is None  # the first reading starts the window
    clock.now += 2.0
    # in 2 s: cpu0 1.5 s user + 0.2 s steal, cpu1 0.5 s system + 1 s idle + 0.3 s iowait; cpu2 (not
    # ours) fully busy; guest time is inside user already; we used 0.6 s user + 0.2 s system
    t = lambda s: round(s * hz)  # noqa: E731
    stat.write_text(stat_lines({0: (t(1.5), 0, 0, 0, 0, 0, 0, t(0.2), t(1.0)),
                                1: (0, 0, t(0.5), t(1.0), t(0.3), 0, 0, 0, 0),
                                2: (t(2.0), 0, 0, 0, 0, 0, 0, 0, 0)}))
    own.write_text(self_stat(t(0.6), t(0.2)))
    assert use.read() == pytest.approx((1.5 + 0.2 + 0.5 - 0.8) / 2.0)


def test_cpu_use_waits_out_a_short_window_and_survives_missing_files(tmp_path):
    stat, own, clock = tmp_path / "stat", tmp_path / "self", Clock()
    stat.write_text(stat_lines({0: (0,) * 9}))
    own.write_text(self_stat(0, 0))
    use = CpuUse(stat, own, cpus={0}, clock=clock)
    assert use.read() is None
    clock.now += 0.01
    stat.write_text(stat_lines({0: (use.hz,) + (0,) * 8}))
    assert use.read() is None  # 10 ms: too few ticks to tell; the window goes on
    clock.now += 1.0
    assert use.read() == pytest.approx(1 / 1.01)
    stat.unlink()
    clock.now += 1.0
    assert use.read() is None
    assert CpuUse(tmp_path / "missing", own).read() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc (other systems: no adaptation)")
def test_cpu_use_sees_a_spinning_process_and_not_its_own_work():
    use = CpuUse()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the spinner running
        use.read()
        own, cpu = use._own(), time.process_time()
        end = time.perf_counter() + 0.8
        while time.perf_counter() < end:  # this process busy on one core meanwhile
            pass
        others = use.read()
        own_seconds, cpu_seconds = (use._own() - own) / use.hz, time.process_time() - cpu
    finally:
        spinner.kill()
        spinner.wait()
    assert others is not None and others >= 0.4, others  # at least the spinner's share of a core
    # our own spin is ours: /proc/self/stat's ticks agree with the kernel's clock of this process
    assert cpu_seconds > 0.1 and abs(own_seconds - cpu_seconds) <= 0.05, (own_seconds, cpu_seconds)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def pool_during_steps(engine, monkeypatch):
    seen = []
    decode = engine._decode

    def recording():
        seen.append(torch.get_num_threads())
        return decode()

    monkeypatch.setattr(engine, "_decode", recording)
    return seen


def test_the_engine_decodes_on_the_governed_count_and_gives_the_pool_back(two_threads, monkeypatch):
    lm = kw.from_hf(FAMILIES["llama"]())
    prompt = [3, 7, 11, 5]
    plain = Engine(lm, max_batch=1, max_length=24, adapt_threads=False)
    assert plain.threads is None
    want = plain.submit(prompt, 8)
    list(plain.run([want]))

    engine = Engine(lm, max_batch=1, max_length=24, adapt_threads=True)
    engine.threads = Threads(most=2, use=Load(0.9), clock=Clock())
    seen = pool_during_steps(engine, monkeypatch)
    seq = engine.submit(prompt, 8)
    list(engine.run([seq]))
    assert seen and set(seen) == {1}
    assert engine.threads.stepped_at is not None  # each step's end marked (what pauses are measured from)
    assert torch.get_num_threads() == 2  # outside a step, the pool as the caller left it
    assert seq.tokens == want.tokens

    decode_one = Engine(lm, max_batch=1, max_length=24, decode_threads=1, adapt_threads=True)
    decode_one.threads = Threads(most=2, use=Load(0.0), clock=Clock())
    seen = pool_during_steps(decode_one, monkeypatch)
    list(decode_one.run([decode_one.submit(prompt, 4)]))
    assert set(seen) == {1}  # a server's decode_threads still bounds decode on a quiet machine


def test_a_pinned_pool_is_kept_and_bad_counts_are_refused(two_threads, monkeypatch):
    monkeypatch.setattr(threads, "_pinned", None)
    assert isinstance(threads.adaptive(), Threads)
    options.use_threads(type("Args", (), {"threads": 2})())
    assert threads.pinned() == 2 and threads.adaptive() is None
    lm = kw.from_hf(FAMILIES["llama"]())
    assert Engine(lm, max_batch=1, max_length=16).threads is None
    assert Engine(lm, max_batch=1, max_length=16, adapt_threads=True).threads is not None
    torch.set_num_threads(1)
    monkeypatch.setattr(threads, "_pinned", None)
    assert threads.adaptive() is None  # one thread: nothing to drop
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match=r"threads=0; expected a positive int"):
        threads.pin(0)
    with pytest.raises(ValueError, match=r"most=0; expected a positive int"):
        Threads(most=0, use=Load(0.0))
    with pytest.raises(TypeError, match=r"adapt_threads='yes'; expected None, True or False"):
        Engine(lm, max_batch=1, max_length=16, adapt_threads="yes")
    monkeypatch.setenv("KVWIRE_THREADS", "0")
    with pytest.raises(ValueError, match=r"KVWIRE_THREADS='0'; expected a positive int"):
        options.use_threads(type("Args", (), {"threads": None})())


def test_kvwire_info_says_whether_steps_follow_the_load(monkeypatch):
    from kvwire.info import info, lines

    monkeypatch.setattr(threads, "_pinned", None)
    assert "threads (fewer while other processes keep cores busy)" in lines(info())[1]
    monkeypatch.setattr(threads, "_pinned", 2)
    report = info()
    assert report["cpu"]["threads_pinned"] is True and "threads (pinned)" in lines(report)[1]
