"""Compiled steps built beside generation: `lm.compile(background=True)` (what `kvwire serve
--compile` uses) exports a new step's graph where generation runs (a few seconds: torch.fx patches
`nn.Module.__call__` process-wide while it traces, so no other thread may run the model meanwhile),
then AOTInductor compiles it in a child process (the minute it takes) while that call signature runs
eager; the next call after the child is done loads the package.

The graph goes to the child without the model's weights: its tensors and example inputs are saved
as meta tensors of the same shape, stride and dtype (a package holds no weights anyway,
`aot_inductor.package_constants_in_so` off), and the child stands in uninitialised CPU memory for
them. Only the tensors whose values a compiler reads travel with them (`weightless`: those it
writes into its code, and those a computation of model tensors alone reads, which it may fold);
a package that took in a tensor sent as a shape only is refused when it is opened (`check_handed`).
The child runs on idle CPU time (`yield_cpu`) with one compile thread and writes the package and
its record as a build in the generating process does (`keep`). Builds run one at a time, in the
order they were asked for; children still compiling when the parent exits are stopped (a package
is written whole or not at all).

Run as `python -m kvwire.generate.background PROGRAM PACKAGE RECORD` (the child's side).
"""
import atexit
import importlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..graph.digest import inlined

_QUEUE = queue.Queue()
_WORKER = []  # the thread that runs the children, once started
_CHILDREN = set()  # children compiling now (stopped at exit)
_LOCK = threading.Lock()
_PENDING = {}  # package path -> the Building writing it (a steered copy asking for it waits on that one)


class Building:
    """A package a child process is compiling: `over()` once it finished (or failed: `failure` says
    why). Made on the thread that exported `program`; the model's tensors are not read after this.

    Args:
        program: the step's `torch.export.ExportedProgram` (its tensors are swapped for meta ones).
        path: the package's path (its record goes beside it as `.json`).
        record: what `keep.keep` writes in the record (the child adds the package's sha256).
    """

    def __init__(self, program, path, record):
        self.path, self.record = Path(path), record
        self.failure = None  # str: the child's failure (its last lines)
        self._over = threading.Event()
        self.shapes = weightless(program)  # the tensors the package must take from its caller
        with _LOCK:
            _PENDING[self.path] = self
        _start_worker()
        _QUEUE.put((self, program))

    @staticmethod
    def at(path):
        """The Building this process has writing the package at `path`, or None."""
        with _LOCK:
            return _PENDING.get(Path(path))

    def over(self):
        return self._over.is_set()

    def wait(self, timeout=None):
        """Block until the child is done (True) or `timeout` seconds pass (False)."""
        return self._over.wait(timeout)

    def _run(self, program):
        try:
            with tempfile.TemporaryDirectory(prefix="kvwire-step-") as tmp:
                tmp = Path(tmp)
                torch.export.save(program, tmp / "program.pt2")
                (tmp / "record.json").write_text(json.dumps(self.record))
                with open(tmp / "log", "w+") as log:
                    code = _child([str(tmp / "program.pt2"), str(self.path), str(tmp / "record.json")], log)
                    log.seek(0)
                    tail = log.read()[-2000:].strip().splitlines()
            if code != 0:
                self.failure = f"exit status {code}: {' | '.join(tail[-3:]) or 'no output'}"
        except Exception as e:  # noqa: BLE001 - said to the caller, which runs the step eager
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            with _LOCK:
                _PENDING.pop(self.path, None)
            self._over.set()


def building():
    """How many packages children of this process are compiling or have queued."""
    with _LOCK:
        return len(_PENDING)


def weightless(program):
    """Swap `program`'s state dict, lifted constants and example inputs for meta tensors of the same
    shape, stride and dtype (in place), except the tensors a compiler reads the values of: those it
    writes into its code (`graph.digest.inlined`: rotary frequencies of a small head) and those a
    computation of model tensors alone reads (a norm's `1 + weight`, which it may fold). Returns the
    names of the tensors sent as shapes that the graph reads: the built package must take every one
    of them from its caller (`check_handed`)."""
    valued, read = _folded_inputs(program)
    shapes = []

    def shape_only(name, value):
        if name is not None and (name in valued or inlined(value)):  # its values are read: kept
            return value
        if name in read:
            shapes.append(name)
        return _like(value, "meta")

    _swap_tensors(program, shape_only)
    return sorted(shapes)


def check_handed(package, shapes):
    """None if the package takes every tensor of `shapes` from its caller, else why not (a tensor sent
    as a shape that the compiler folded in: its package would compute with uninitialised memory)."""
    taken = set(package.loader.get_constant_fqns())
    baked = [name for name in shapes if name not in taken]
    return None if not baked else f"it folded in tensors it was given as shapes only: {', '.join(baked[:3])}"


def _folded_inputs(program):
    """({names of model tensors read by a computation of model tensors alone}, {names the graph reads})."""
    sig = program.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    constant = set()  # nodes computed from model tensors alone
    valued, read = set(), set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if node.name in names:
                constant.add(node)
                if node.users:
                    read.add(names[node.name])
        elif node.op == "get_attr":
            constant.add(node)
        elif node.op == "call_function":
            inputs = node.all_input_nodes
            if inputs and all(n in constant for n in inputs):
                constant.add(node)
                valued.update(names[n.name] for n in inputs if n.op == "placeholder")
    return valued, read


def materialised(program):
    """The inverse of `weightless`: uninitialised CPU tensors in place of meta ones (in place)."""
    _swap_tensors(program, lambda name, value: _like(value, "cpu") if value.is_meta else value)
    return program


def _swap_tensors(program, swap):
    """Replace each tensor of `program`'s state dict and lifted constants by `swap(name, tensor)`,
    and each tensor of its example inputs by `swap(None, tensor)` (in place)."""
    for table in (program.state_dict, program.constants):
        for name, value in list(table.items()):
            if isinstance(value, torch.Tensor):
                table[name] = swap(name, value)
    program.example_inputs = tree_map(lambda v: swap(None, v) if isinstance(v, torch.Tensor) else v,
                                      program.example_inputs)


def _like(tensor, device):
    out = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return nn.Parameter(out, requires_grad=False) if isinstance(tensor, nn.Parameter) else out


def _start_worker():
    with _LOCK:
        if not _WORKER:
            thread = threading.Thread(target=_work, name="kvwire-step-builder", daemon=True)
            thread.start()
            _WORKER.append(thread)
            atexit.register(_stop_children)


def _work():
    while True:
        building, program = _QUEUE.get()
        building._run(program)


def _child(argv, log):
    """Run the child on `argv`, its output to `log`; its exit status."""
    root = str(Path(__file__).resolve().parents[2])  # this kvwire's sources, whatever the child's path says
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
               TORCHINDUCTOR_COMPILE_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvwire.generate.background", *argv], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    with _LOCK:
        _CHILDREN.add(proc)
    try:
        return proc.wait()
    finally:
        with _LOCK:
            _CHILDREN.discard(proc)


def _stop_children():
    with _LOCK:
        children = list(_CHILDREN)
    for proc in children:
        proc.kill()


def yield_cpu():
    """Run this process (and the threads and compilers it starts after) at a nice of 10 and, where
    Linux allows it, under SCHED_IDLE: on CPU time nothing else wants. The parent's generation goes
    first: a server decoding on one core of two leaves the other to the build and takes it back at
    once (a nice of 10 alone still gets a share of a core the parent's threads want, stalling their
    barriers). On a machine kept busy, builds wait for an idle moment."""
    if hasattr(os, "nice"):
        os.nice(10)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a sandbox that forbids it: the nice alone
            pass


def main(argv):
    """The child: compile the saved program into the package and its record."""
    if len(argv) != 3:
        raise SystemExit(f"usage: python -m kvwire.generate.background PROGRAM PACKAGE RECORD (got {argv})")
    yield_cpu()
    from ..layers.linear import allow_packs_in_compiled_graphs
    from .keep import keep

    importlib.import_module("kvwire.kernels.ggml.ops")  # the ggml operators' schemas, for the saved graph
    allow_packs_in_compiled_graphs()
    program = materialised(torch.export.load(argv[0]))
    keep(program, Path(argv[1]), json.loads(Path(argv[2]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
