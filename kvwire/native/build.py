"""Build a C library with the machine's compiler on first use, into the kvwire cache.

A library is keyed by its sources, its flags, the compiler and whatever `stamp` the caller adds (the
ggml bridge adds the ggml and torch it links): changed sources build anew, and two processes building
the same library at once are harmless (each compiles into a temporary folder and renames the result
into place). Nothing is downloaded: a machine without a C compiler gets `BuildError`, and callers
fall back to a path that needs none.

Example:
    >>> path = library("kvw_gemv", [Path("gemv.c")], ["-O3", "-mavx512f", "-fopenmp"])  # doctest: +SKIP
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..io.weights_cache import cache_root


class BuildError(RuntimeError):
    """No C compiler on this machine, or compiling kvwire's sources failed."""


def compiler(variable, *names, error=BuildError, what="kvwire's C kernels"):
    """The compiler `$variable` names, else the first of `names` on PATH; `error` if there is none."""
    found = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if found is None:
        raise error(f"building {what} needs {names[0]} (or ${variable}); none on PATH")
    return found


def run(cmd, error=BuildError, what="kvwire's C kernels"):
    """Run a compiler command; `error` with its message (the last 2000 characters) if it fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # $CC names a program that is not there, or cannot run
        raise error(f"building {what} failed ({' '.join(cmd)}): {e}") from e
    if done.returncode != 0:
        raise error(f"building {what} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")


def library(name, sources, flags, stamp=b""):
    """The path of lib`name`.so built from C `sources` with `flags`, compiling it if this machine has
    not yet. Raises `BuildError` (no compiler, a failed build)."""
    cc = compiler("CC", "gcc", "cc")
    key = b"".join(Path(s).read_bytes() for s in sources) + " ".join([cc, *flags]).encode() + stamp
    target = cache_root() / "native" / hashlib.sha256(key).hexdigest()[:16] / f"lib{name}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        run([cc, *flags, "-shared", "-fPIC", *map(str, sources), "-o", str(built)])
        os.replace(built, target)  # atomic: a concurrent build of the same sources is harmless
    return target


def loaded(cache, build, declare):
    """A kernel library built on first use and loaded once a process: `cache["lib"]`, after
    build() -> its path and declare(lib) (argument types); a failed build raises `BuildError`,
    remembered in `cache["error"]` (one try a process). Loaded after torch: its libgomp serves."""
    if "lib" not in cache and "error" not in cache:
        try:
            # PyDLL: the GIL stays held during a call (a ctypes.CDLL call drops it, and getting it back
            # behind another thread cost compiled decode steps ~11 ms each, 127 GEMV calls a step)
            lib = ctypes.PyDLL(str(build()))
        except (BuildError, OSError) as e:
            cache["error"] = BuildError(str(e))
        else:
            declare(lib)
            cache["lib"] = lib
    if "error" in cache:
        raise cache["error"]
    return cache["lib"]


def builds(load):
    """Whether load() (a `loaded` library's loader) succeeds here, building the library if needed."""
    try:
        load()
    except BuildError:
        return False
    return True
