"""Build and load kvwire's bridge to ggml's CPU kernels (`matmul.c`, `x16.c`, `op.cpp`).

ggml ships with llama-cpp-python (`pip install "kvwire[ggml]"`): its shared libraries and headers.
The bridge is compiled with the machine's C and C++ compilers on first use (~15 s, mostly torch's
headers) into the kvwire cache, keyed by its sources, the ggml it links and the torch it is built
against. It is loaded twice over: by torch (`op.cpp` registers the kernels of `kvwire::ggml_matmul`
and `kvwire::ggml_matmuls`) and by ctypes (`matmul.c`'s helpers). Torch must be imported first so
the bridge's OpenMP threads come from torch's libgomp (one thread pool).
"""
import ctypes
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

import torch  # imported before the bridge loads: its libgomp becomes the bridge's

from ...io.weights_cache import cache_root
from ...native.build import compiler, run

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matmul.c", "x16.c", "op.cpp"))
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
        target = bridge_path()
        if not target.exists():
            _build(target, lib_dir, include)
        torch.ops.load_library(str(target))  # after linear.py declared the operator's schema
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        lib.kvw_init()
        _LIB["lib"] = lib
    return _LIB["lib"]


def bridge_path():
    """Where the bridge for these sources, this ggml and this torch is (or will be) built."""
    ggml = ggml_dirs()[0] / "libggml-cpu.so"
    stamp = b"".join(s.read_bytes() for s in SOURCES) + f"{ggml.resolve()} {ggml.stat().st_mtime_ns} " \
        f"{torch.__version__} {Path(torch.__file__).parent}".encode()
    return cache_root() / "ggml" / hashlib.sha256(stamp).hexdigest()[:16] / "libkvwire_ggml.so"


def loaded_or_built():
    """Whether the bridge is loaded, or built and waiting to be (using it then costs no build)."""
    return "lib" in _LIB or bridge_path().exists()


def _build(target, lib_dir, include):
    cc = _compiler("CC", "gcc", "cc")
    cxx = _compiler("CXX", "g++", "c++")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        c_objects, so = [f"{tmp}/{source.stem}.o" for source in SOURCES[:2]], f"{tmp}/{target.name}"
        for source, c_object in zip(SOURCES, c_objects):
            _run([cc, "-O2", "-fPIC", "-fopenmp", "-c", str(source), f"-I{include}", "-o", c_object])
        _run([cxx, "-O2", "-shared", "-fPIC", "-fopenmp", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
              f"-I{torch_dir / 'include'}", str(SOURCES[2]), *c_objects, f"-L{lib_dir}", f"-L{torch_dir / 'lib'}",
              "-lggml-cpu", "-lggml-base", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}",
              f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", so])
        os.replace(so, target)  # atomic: a concurrent build of the same sources is harmless


def _compiler(variable, *names):
    return compiler(variable, *names, error=GGMLUnavailable, what="kvwire's ggml bridge")


def _run(cmd):
    run(cmd, error=GGMLUnavailable, what="kvwire's ggml bridge")


def _declare(lib):
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvw_init.restype = None
    lib.kvw_block_size.argtypes, lib.kvw_block_size.restype = [i32], i64
    lib.kvw_row_bytes.argtypes, lib.kvw_row_bytes.restype = [i32, i64], i64
    lib.kvw_supported.argtypes, lib.kvw_supported.restype = [i32], i32
    lib.kvw_dequantize.argtypes, lib.kvw_dequantize.restype = [i32, ptr, i64, i64, ptr, i32], i32
    lib.kvw_x16_supported.restype = i32
    lib.kvw_x16_repack_rows.argtypes, lib.kvw_x16_repack_rows.restype = [i32, ptr, ptr, i64, i64, i32, i32], None
    lib.kvw_quantize.argtypes, lib.kvw_quantize.restype = [i32, ptr, ptr, i64, i64], i64
