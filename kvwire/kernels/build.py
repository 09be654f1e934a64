"""Build a shared library with the machine's compilers on first use, into the kvwire cache; load it once.

One helper for both of kvwire's C builds: its own kernels (`native/`, C only) and the ggml bridge
(`ggml/`: C objects linked into a C++ torch extension). A library is keyed by its sources, its
flags, the compilers and whatever `stamp` the caller adds (the ggml bridge adds the ggml and torch
it links): changed sources build anew, and two processes building the same library at once are
harmless (each compiles into a temporary folder and renames the result into place). Nothing is
downloaded: a machine without a compiler gets `BuildError` (or the caller's `error`), and callers
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

from .switches import cache_root


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


def library(name, sources, flags, stamp=b"", cxx=None, folder="native", error=BuildError,
            what="kvwire's C kernels"):
    """The path of lib`name`.so in the cache's `folder`, compiling it if this machine has not yet.

    C only (`cxx` None): `sources` compiled and linked with `flags`. With `cxx` = (C++ sources, C++
    flags, link flags): each C source compiled to an object with `flags`, then the C++ sources and
    the objects linked into the library by the C++ compiler. Raises `error` (no compiler, a failed
    build)."""
    target, cc, cxx_tool = _target(name, sources, flags, stamp, cxx, folder, error, what)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        if cxx is None:
            run([cc, *flags, "-shared", "-fPIC", *map(str, sources), "-o", str(built)], error, what)
        else:
            objects = [f"{tmp}/{Path(source).stem}.o" for source in sources]
            for source, obj in zip(sources, objects):
                run([cc, *flags, "-fPIC", "-c", str(source), "-o", obj], error, what)
            run([cxx_tool, *cxx[1], "-shared", "-fPIC", *map(str, cxx[0]), *objects, *cxx[2], "-o", str(built)],
                error, what)
        os.replace(built, target)  # atomic: a concurrent build of the same sources is harmless
    return target


def built(name, sources, flags, stamp=b"", cxx=None, folder="native"):
    """Whether `library` with these arguments would find the library already built (builds nothing;
    False where a compiler is missing)."""
    try:
        return _target(name, sources, flags, stamp, cxx, folder, BuildError, "")[0].exists()
    except BuildError:
        return False


def _target(name, sources, flags, stamp, cxx, folder, error, what):
    """(the library's path in the cache, the C compiler, the C++ compiler or None)."""
    cc = compiler("CC", "gcc", "cc", error=error, what=what)
    cxx_tool = None if cxx is None else compiler("CXX", "g++", "c++", error=error, what=what)
    everything = [*sources, *(cxx[0] if cxx else ())]
    command = [cc, *flags, *([cxx_tool, *cxx[1], *cxx[2]] if cxx else [])]
    key = b"".join(Path(s).read_bytes() for s in everything) + " ".join(command).encode() + stamp
    return cache_root() / folder / hashlib.sha256(key).hexdigest()[:16] / f"lib{name}.so", cc, cxx_tool


def loaded(cache, build, declare):
    """A kernel library built on first use and loaded once a process: `cache["lib"]`, after
    build() -> its path and declare(lib) (argument types); a failed build raises `BuildError`,
    remembered in `cache["error"]` (one try a process). Loaded after torch: its libgomp serves."""
    if "lib" not in cache and "error" not in cache:
        try:
            # PyDLL: the GIL stays held during a call (a ctypes.CDLL call drops it, and getting it back
            # behind another thread costs each compiled decode step milliseconds, ~127 calls a step)
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
