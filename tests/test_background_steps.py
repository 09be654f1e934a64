"""Compiled steps built in a child process (`kvwire.generate.background`): generation goes on eager
while the child compiles, the package it writes gives eager's tokens and is kept for other models
and processes, a failed child is said and leaves the step eager, and the child is handed no weights."""
import os
import subprocess
import sys
import threading

import pytest
import torch

import kvwire as kw
from kvwire.generate import background
from kvwire.generate.ahead import EAGER, AheadDecode, Package
from kvwire.generate.background import Building

from .conftest import FAMILIES
from .test_ahead import _greedy, _steered


def _buildings(lm):
    return [r for r in lm._decoder().runners.values() if isinstance(r, Building)]


def test_a_step_builds_in_a_child_while_generation_runs_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = _steered(0)
    eager = _greedy(lm)
    lm.compile(bucket=32, prefill_tokens=0, background=True)  # the decode step only: one child
    assert _greedy(lm) == eager  # ran eager: the child is still compiling
    (building,) = _buildings(lm)
    assert isinstance(lm._decoder(), AheadDecode) and lm._decoder().built == 0
    assert building.wait(300) and building.failure is None
    assert _greedy(lm) == eager
    (package,) = lm._decoder().runners.values()
    assert isinstance(package, Package) and lm._decoder().built == 1
    assert len(list((tmp_path / "steps").rglob("*.pt2"))) == 1

    other = _steered(1)  # the same structure, other vectors: loads the kept package, builds nothing
    other_eager = _greedy(other)
    other.compile(bucket=32, prefill_tokens=0, background=True)
    assert _greedy(other) == other_eager and other._decoder().built == 0
    assert isinstance(next(iter(other._decoder().runners.values())), Package)


def test_a_failed_child_is_said_and_its_step_stays_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))

    release = threading.Event()

    def failing(argv, log):  # a child that fails once the test lets it
        release.wait(60)
        log.write("compiler said no\n")
        log.flush()
        return 3

    monkeypatch.setattr(background, "_child", failing)
    lm = kw.from_hf(FAMILIES["llama"]())
    ids = torch.tensor([3, 17, 42, 9, 55])
    eager = lm.generate(ids, max_new_tokens=6, ignore_eos=True).tolist()
    lm.compile(bucket=32, prefill_tokens=0, background=True)
    assert lm.generate(ids, max_new_tokens=6, ignore_eos=True).tolist() == eager
    (building,) = _buildings(lm)
    release.set()
    assert building.wait(120)
    with pytest.warns(UserWarning, match=r"compile in a child process failed \(exit status 3: compiler said no\)"):
        assert lm.generate(ids, max_new_tokens=6, ignore_eos=True).tolist() == eager
    assert list(lm._decoder().runners.values()) == [EAGER] and not list(tmp_path.rglob("*.pt2"))


def test_a_package_that_folded_in_a_tensor_sent_as_a_shape_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    # rotary frequencies of a head of 16 (8 values) are written into the code: sent without them,
    # the child compiles zeros in; the package must not serve
    monkeypatch.setattr(background, "inlined", lambda t: False)
    lm = _steered(0)
    eager = _greedy(lm)
    lm.compile(bucket=32, prefill_tokens=0, background=True)
    _greedy(lm)
    (building,) = _buildings(lm)
    assert any(name.endswith("inv_freq") for name in building.shapes)
    assert building.wait(300) and building.failure is None
    with pytest.warns(UserWarning, match="not used: it folded in tensors it was given as shapes only: .*inv_freq"):
        assert _greedy(lm) == eager
    assert list(lm._decoder().runners.values()) == [EAGER] and not list(tmp_path.rglob("*.json"))


def test_the_child_is_handed_shapes_not_weights():
    lm = kw.from_hf(FAMILIES["llama"]())
    weight = lm.head.weight
    kept = weight.detach().clone()
    x = torch.randn(2, weight.shape[1])
    program = torch.export.export(lm.head, (x,), strict=False)
    background.weightless(program)
    assert all(t.device.type == "meta" for t in program.state_dict.values())
    assert program.example_inputs[0][0].device.type == "meta"
    assert torch.equal(weight, kept) and weight.device.type == "cpu"  # the model's own tensors untouched
    background.materialised(program)
    (restored,) = program.state_dict.values()
    assert restored.device.type == "cpu" and restored.shape == weight.shape and restored.stride() == weight.stride()
    assert restored.data_ptr() != weight.data_ptr()


def test_children_still_compiling_are_stopped_at_exit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    background._CHILDREN.add(proc)
    try:
        background._stop_children()
        assert proc.wait(timeout=10) != 0
    finally:
        background._CHILDREN.discard(proc)
        proc.kill()


def test_the_child_refuses_a_wrong_command_line():
    out = subprocess.run([sys.executable, "-m", "kvwire.generate.background", "only-one"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "usage: python -m kvwire.generate.background PROGRAM PACKAGE RECORD" in out.stderr


def _sched_idle_allowed():
    probe = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))"
    return hasattr(os, "SCHED_IDLE") and subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


@pytest.mark.skipif(not _sched_idle_allowed(), reason="SCHED_IDLE is Linux's, and this sandbox may forbid it: "
                                                      "the child then only nices itself")
def test_the_child_builds_on_idle_cpu_time_and_so_do_its_threads_and_compilers():
    """The builder yields every core to the generating process: its threads and the compilers it
    starts inherit SCHED_IDLE (and a nice 10 above this process's)."""
    code = ("import os, subprocess, sys, threading\n"
            "from kvwire.generate.background import yield_cpu\n"
            "yield_cpu()\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0))); t.start(); t.join()\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'],\n"
            "                       capture_output=True, text=True).stdout.strip()\n"
            "print(os.sched_getscheduler(0), seen[0], child, os.nice(0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    idle = str(os.SCHED_IDLE)
    assert out.stdout.split() == [idle, idle, idle, str(min(19, os.nice(0) + 10))]
