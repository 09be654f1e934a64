"""Build and load kvwire's bridge to ggml's CPU kernels (`matmul.c`, `x16.c`, `op.cpp`).

ggml ships with llama-cpp-python (`pip install "kvwire[ggml]"`): its shared libraries and headers.
The bridge is compiled with the machine's C and C++ compilers on first use (~15 s, mostly torch's
headers) into the kvwire cache by `kernels.build`, keyed by its sources, the ggml it links and the
torch it is built against. It is loaded twice over: by torch (`op.cpp` registers the kernels of the
`kvwire::ggml_*` operators `ops.py` declares) and by ctypes (`matmul.c`'s helpers). Torch must be
imported first so the bridge's OpenMP threads come from torch's libgomp (one thread pool).
"""
import ctypes
import importlib.util
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch  # imported before the bridge loads: its libgomp becomes the bridge's

from ..build import built, library as build_library
from . import ops  # noqa: F401 - the operators' schemas, before op.cpp registers their kernels

C_SOURCES = tuple(Path(__file__).with_name(name) for name in ("matmul.c", "x16.c"))
CXX_SOURCES = (Path(__file__).with_name("op.cpp"),)
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
        target = build_library("kvwire_ggml", C_SOURCES, *_build_args(), error=GGMLUnavailable,
                               what="kvwire's ggml bridge")
        torch.ops.load_library(str(target))
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        lib.kvw_init()
        _LIB["lib"] = lib
    return _LIB["lib"]


def loaded_or_built():
    """Whether the bridge is loaded, or built and waiting to be (using it then costs no build)."""
    return "lib" in _LIB or built("kvwire_ggml", C_SOURCES, *_build_args())


@lru_cache(maxsize=None)
def x16_runs(qtype=None):
    """Whether this CPU runs the x16 kernel for ggml's type number `qtype` (None: for any type), as
    the bridge finds it: Q4_1, Q5_0, Q8_0 and Q4_K with AVX-512 F, BW, VL and VNNI; Q4_1, Q8_0,
    Q4_K and Q6_K with AVX2 (FMA, F16C) and no VNNI."""
    return bool(library().kvw_x16_supported(-1 if qtype is None else int(qtype)))


@contextmanager
def as_avx2():
    """Within it, the x16 kernel runs as on a CPU with AVX2 but no AVX-512 VNNI (Q4_1, Q8_0, Q4_K and Q6_K
    on its AVX2 kernels; Q5_0 on ggml's), so a machine with AVX-512 tests the AVX2 path too.
    Modules built inside keep the layout chosen there. Not thread-safe: for tests and benchmarks.

    Example:
        >>> with as_avx2():
        ...     x16_runs(6)  # ggml's Q5_0: left to ggml's kernels on AVX2
        False
    """
    before = library().kvw_x16_as_avx2(1)
    x16_runs.cache_clear()
    try:
        yield
    finally:
        library().kvw_x16_as_avx2(before)
        x16_runs.cache_clear()


def _build_args():
    """(C flags, stamp, (C++ sources, C++ flags, link flags), cache folder) for `kernels.build.library`."""
    lib_dir, include = ggml_dirs()
    ggml = lib_dir / "libggml-cpu.so"
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    stamp = f"{ggml.resolve()} {ggml.stat().st_mtime_ns} {torch.__version__} {torch_dir}".encode()
    cxx_flags = ["-O2", "-fopenmp", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}"]
    link = [f"-L{lib_dir}", f"-L{torch_dir / 'lib'}", "-lggml-cpu", "-lggml-base", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{lib_dir}", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    return ["-O2", "-fopenmp", f"-I{include}"], stamp, (CXX_SOURCES, cxx_flags, link), "ggml"


def _declare(lib):
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvw_init.restype = None
    lib.kvw_block_size.argtypes, lib.kvw_block_size.restype = [i32], i64
    lib.kvw_row_bytes.argtypes, lib.kvw_row_bytes.restype = [i32, i64], i64
    lib.kvw_supported.argtypes, lib.kvw_supported.restype = [i32], i32
    lib.kvw_dequantize.argtypes, lib.kvw_dequantize.restype = [i32, ptr, i64, i64, ptr, i32], i32
    lib.kvw_x16_supported.argtypes, lib.kvw_x16_supported.restype = [i32], i32
    lib.kvw_x16_as_avx2.argtypes, lib.kvw_x16_as_avx2.restype = [i32], i32
    lib.kvw_x16_repack_rows.argtypes, lib.kvw_x16_repack_rows.restype = [i32, ptr, ptr, i64, i64, i32, i32], None
    lib.kvw_quantize.argtypes, lib.kvw_quantize.restype = [i32, ptr, ptr, i64, i64], i64
