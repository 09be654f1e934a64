"""Helpers shared by the benchmarks: the machine header, peak memory, workers in subprocesses
that may crash (a peer's row then says how), libraries timed in processes of their own, and the
test-only way to make a peer crash."""
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata

# the CPU features kvwire's and its peers' kernels branch on
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
CRASH_ENV = "KVWIRE_BENCH_CRASH_PEER"  # test only: "PEER" crashes it everywhere, "PEER@timed" outside probes
PROBE_ENV = "KVWIRE_BENCH_PROBE"  # set in probe children


def header(threads, cpuinfo="/proc/cpuinfo"):
    """One line: the CPU model, which of FLAGS it has, torch's version and the thread count."""
    name, flags = "unknown CPU", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    have = " ".join(f"{flag}{'+' if flag in flags else '-'}" for flag in FLAGS)
    return f"CPU: {name} ({os.cpu_count()} cores; {have}); torch {torch}, {threads} thread{'s' * (threads != 1)}"


def cpu_paths():
    """kvwire's kernel choices for this CPU (kvwire.kernels.cpu.report, and the kernel of each format x16
    covers where ggml is installed), for benchmark headers."""
    import importlib.util

    from kvwire.kernels.cpu import report

    line = "kvwire " + report()
    if importlib.util.find_spec("llama_cpp") is not None:
        from kvwire.kernels.cpu import ggml_kernel
        from kvwire.kernels.ggml.lib import x16_runs
        from kvwire.quant.ggml.linear import qtype_of

        kernel = ggml_kernel()
        for name in ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
            line += f"; {name} kernel: {kernel if kernel == 'ggml' or x16_runs(int(qtype_of(name))) else 'ggml'}"
    return line


def peak_rss_gb():
    """This process's peak resident memory in GB: VmHWM of /proc/self/status on Linux. Not `ru_maxrss`
    there: a child (fork, or subprocess's fork + exec) starts with its parent's, so a worker of a large
    parent read the parent's size (0.22 GB for a child of a 222 MB parent whose VmHWM was 11 MB).
    Elsewhere ru_maxrss: bytes on macOS, kB on the BSDs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e6  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak / 1e6


@dataclass(frozen=True)
class Worker:
    """A worker's outcome: `value` (the JSON it printed last) when it succeeded, else `failure`:
    what happened, in words for a table row ("killed by SIGSEGV", "ValueError: ...")."""

    value: object = None
    failure: str = ""

    @property
    def ok(self):
        return not self.failure


def run_worker(script, args, env=None, timeout=None):
    """Run `python script args...` and parse the JSON it prints last; never raises for the child.

    A child killed by a signal, exiting non-zero (its stderr's last line, usually the exception),
    running past `timeout` seconds or printing no JSON gives a `Worker` with `failure` set."""
    try:
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return Worker(failure=f"timed out after {timeout} s")
    failure = describe_exit(out.returncode, out.stderr)
    if failure:
        return Worker(failure=failure)
    try:
        return Worker(value=json.loads(out.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        return Worker(failure="printed no result")


class LibraryDied(RuntimeError):
    """A `LibraryProcess` whose child died; the message says how ("killed by SIGSEGV", the exception)."""


ANSWER = "@@bench-answer "  # marks the protocol's lines among whatever a library prints to stdout


class LibraryProcess:
    """A library loaded in a child process of its own (`python script args...`) that runs what the
    parent asks, one request at a time, and answers with what it measured: the parent holds no
    library, so libraries never share thread pools or a heap, and their timed runs still interleave
    (only one process works at any moment). The child's side is `answer_requests`.

    A child that dies (a native crash, an exception) raises `LibraryDied` on the next request.

    Example:
        >>> with LibraryProcess("bench/generate.py", ["--serve", "kvwire", "float32"]) as child:
        ...     child.ask(op="generate", ids=[[2, 9]], n=4)["seconds"]
    """

    def __init__(self, script, args, env=None):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks
        # a library's own output may be any bytes: decoded with replacements, never an error here
        self._child = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self._stderr, text=True, errors="replace",
                                       env={**os.environ, **(env or {})})
        try:
            self.ready = self._answer()  # what the child said once loaded
        except LibraryDied:
            self.close()
            raise

    def ask(self, **request):
        """Send one request (JSON keywords); the child's answer (a dict)."""
        try:
            self._child.stdin.write(json.dumps(request) + "\n")
            self._child.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: _answer says how
        return self._answer()

    def _answer(self):
        for line in self._child.stdout:
            _, marked, answer = line.partition(ANSWER)  # after a library's unfinished line, if any
            if marked:
                return json.loads(answer)
        returncode = self._child.wait()
        self._stderr.seek(0)
        raise LibraryDied(describe_exit(returncode, self._stderr.read()) or "exited before answering")

    def close(self):
        try:
            self._child.stdin.close()  # the child's loop ends at end of input
            self._child.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self._child.kill()
            self._child.wait()
        self._child.stdout.close()
        self._stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def answer_requests(handle, ready=None):
    """The child's side of `LibraryProcess`: say `ready` (a dict), then answer each request line with
    `handle(request)` until the parent closes stdin."""
    def say(value):  # on a line of its own, even after a library's unfinished one
        print("\n" + ANSWER + json.dumps(value), flush=True)
    say(ready or {})
    for line in sys.stdin:
        say(handle(json.loads(line)))


def describe_exit(returncode, stderr):
    """"" for 0; "killed by SIGSEGV" for a signal; the last stderr line (the exception) otherwise,
    "not installed (...)" when that is an ImportError."""
    if returncode == 0:
        return ""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {returncode}"
    if last.startswith(("ModuleNotFoundError", "ImportError")):
        return f"not installed ({last})"
    return last


def probe_peers(script, peers, args=(), env=None, timeout=600):
    """{peer: Worker} from `python script --probe PEER args...`, each peer in its own child (the
    script loads the peer and generates 2 tokens), so a peer that crashes takes nothing with it."""
    return {peer: run_worker(script, ["--probe", peer, *args], {**(env or {}), PROBE_ENV: "1"}, timeout)
            for peer in peers}


def with_fallback(run, peers):
    """(Worker, note): run(peers); if that child dies with peers in it, run([]) and say why."""
    result = run(peers)
    if result.ok or not peers:
        return result, ""
    note = f"the timed worker with {', '.join(peers)} {result.failure}; re-run without them"
    return run([]), note


def crash_if_asked(peer):
    """Test only: kill this process with SIGSEGV if KVWIRE_BENCH_CRASH_PEER names `peer` (as a
    peer's native code does on some CPUs); "PEER@timed" spares probe children."""
    asked = os.environ.get(CRASH_ENV, "")
    name, _, where = asked.partition("@")
    if name == peer and not (where == "timed" and os.environ.get(PROBE_ENV)):
        os.kill(os.getpid(), signal.SIGSEGV)


def parse_variant(variant):
    """"dtype[+scheme][+head=Q][+compile][+cpp]" -> dict(dtype, quantize, head, compile, cpp).

    scheme: int8 / int4 (PyTorch kernels), gguf (the GGUF's own blocks) or a ggml type; head=Q
    re-quantises only the logits head to ggml type Q; compile: `lm.compile()`; cpp: compile with
    Inductor's C++ wrapper (`lm.compile(options={"cpp_wrapper": True})`)."""
    dtype, *parts = variant.split("+")
    spec = {"dtype": dtype, "quantize": None, "head": None, "compile": False, "cpp": False}
    for part in parts:
        if part in ("compile", "cpp"):
            spec["compile"] = True
            spec["cpp"] = spec["cpp"] or part == "cpp"
        elif part.startswith("head="):
            spec["head"] = part.removeprefix("head=")
        else:
            spec["quantize"] = part
    return spec


def load_variant(variant, model="gemma3-270m"):
    """Preset `model` as `variant` names it (compiled lazily: the first decode step compiles)."""
    import kvwire as kw

    spec = parse_variant(variant)
    at_load = spec["head"] if spec["quantize"] == "gguf" else None  # re-quantised from the file's blocks
    lm = kw.load(model, dtype=spec["dtype"], progress=False, quantize=spec["quantize"], head=at_load)
    if spec["head"] and not at_load:
        kw.quantize(lm, spec["head"], layers=False)
    if not spec["compile"]:
        return lm
    return lm.compile(options={"cpp_wrapper": True}) if spec["cpp"] else lm.compile()
