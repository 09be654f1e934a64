"""Build and load kvwire's bridge to ggml's CPU kernels (`matmul.c`).

ggml ships with llama-cpp-python (`pip install "kvwire[ggml]"`): its shared libraries and headers.
The bridge is compiled with the machine's C compiler on first use (well under a second) into the
kvwire cache, keyed by its source and the ggml it links, and loaded with ctypes. Torch must be
imported first so the bridge's OpenMP threads come from torch's libgomp (one thread pool).
"""
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours)

from ...io.weights_cache import cache_root

SOURCE = Path(__file__).with_name("matmul.c")
INSTALL_HINT = 'ggml kernels need llama-cpp-python, which ships ggml: pip install "kvwire[ggml]"'
_LIB = {}


class GGMLUnavailable(RuntimeError):
    """ggml (llama-cpp-python) or a C compiler is missing, or the bridge failed to build."""


def ggml_dirs():
    """(lib folder, include folder) of the ggml that llama-cpp-python installed."""
    spec = importlib.util.find_spec("llama_cpp")  # found, not imported: importing loads libllama
    if spec is None or not spec.submodule_search_locations:
        raise GGMLUnavailable(INSTALL_HINT)
    package = Path(next(iter(spec.submodule_search_locations)))
    lib, include = package / "lib", package.parent / "include"
    if not (lib / "libggml-cpu.so").exists() or not (include / "ggml-cpu.h").exists():
        raise GGMLUnavailable(f"llama-cpp-python at {package} has no libggml-cpu.so / ggml-cpu.h; {INSTALL_HINT}")
    return lib, include


def library():
    """The loaded bridge (ctypes.CDLL), built on first use."""
    if "lib" not in _LIB:
        lib_dir, include = ggml_dirs()
        ggml = lib_dir / "libggml-cpu.so"
        stamp = SOURCE.read_bytes() + str(ggml.resolve()).encode() + str(ggml.stat().st_mtime_ns).encode()
        target = cache_root() / "ggml" / hashlib.sha256(stamp).hexdigest()[:16] / "libkvwire_ggml.so"
        if not target.exists():
            _build(target, lib_dir, include)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        lib.kvw_init()
        _LIB["lib"] = lib
    return _LIB["lib"]


def _build(target, lib_dir, include):
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise GGMLUnavailable("ggml kernels need a C compiler (gcc) to build kvwire's bridge; none on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        pass
    cmd = [compiler, "-O2", "-shared", "-fPIC", "-fopenmp", str(SOURCE), f"-I{include}", f"-L{lib_dir}",
           "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib_dir}", "-o", tmp.name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp.name)
        raise GGMLUnavailable(f"building kvwire's ggml bridge failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    os.replace(tmp.name, target)  # atomic: a concurrent build of the same source is harmless


def _declare(lib):
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvw_init.restype = None
    lib.kvw_block_size.argtypes, lib.kvw_block_size.restype = [i32], i64
    lib.kvw_row_bytes.argtypes, lib.kvw_row_bytes.restype = [i32, i64], i64
    lib.kvw_supported.argtypes, lib.kvw_supported.restype = [i32], i32
    lib.kvw_matmul.argtypes, lib.kvw_matmul.restype = [i32, ptr, i64, i64, ptr, i64, ptr, i32], i32
    lib.kvw_dequantize.argtypes, lib.kvw_dequantize.restype = [i32, ptr, i64, i64, ptr, i32], None
    lib.kvw_quantize.argtypes, lib.kvw_quantize.restype = [i32, ptr, ptr, i64, i64], i64
