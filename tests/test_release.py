"""Graph modules kvwire makes give back torch.fx's copy of their generated source when collected:
a steered copy per request must not grow memory (bench/long_run.py --steer-each-call measures it)."""
import ctypes
import ctypes.util
import gc
import linecache
import os

import pytest
import torch

import kvwire as kw
from kvwire.graph.release import _source_key, kept_source_bytes
from kvwire.io import heap

from .conftest import FAMILIES

IDS = torch.tensor([[3, 17, 42, 9]])


def test_collected_copies_leave_no_generated_source_behind():
    lm = kw.from_hf(FAMILIES["gemma3"]())
    vec = kw.ControlVector({1: torch.ones(lm.head.weight.shape[1])})
    lm.steer(vec, 0.5).generate(IDS, max_new_tokens=2)
    gc.collect()
    before = kept_source_bytes()
    for strength in range(12):
        lm.steer(vec, float(strength)).edit(kw.skip("layers.2")).generate(IDS, max_new_tokens=2)
    gc.collect()
    assert kept_source_bytes() == before  # was ~7 kB more per copy
    live = lm.steer(vec, 1.0)
    live.generate(IDS, max_new_tokens=2)
    assert kept_source_bytes() > before
    key = _source_key(live.cached.graph_module)
    assert key is not None and "forward_cached" in "".join(linecache.getlines(key))  # tracebacks still read it


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(heap._TRIM is None, reason="no glibc malloc_trim on this platform: nothing to give back")
def test_freed_heap_pages_go_back_to_the_os():
    """What a large tokenizer load leaves: many small chunks freed below one still in use, which
    free() alone never returns (the heap's top is pinned)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(200) for _ in range(300_000)]  # ~64 MB of small chunks
    for c in chunks:
        ctypes.memset(c, 1, 200)
    pin = libc.malloc(200)
    for c in chunks:
        libc.free(c)
    before = _rss_bytes()
    assert heap.give_back_freed_memory()
    assert before - _rss_bytes() > 32 << 20
    libc.free(pin)


def _mapped_rss(path):
    """Resident bytes of this process's mappings of `path`."""
    total, current = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                current = rest.split()[-1] if len(rest.split()) >= 5 else ""
            elif head == "Rss:" and current == str(path):
                total += int(rest.split()[0]) * 1024
    return total


@pytest.mark.skipif(heap._MADVISE is None, reason="no madvise (not Linux): file pages are not given back")
def test_file_pages_go_back_and_read_again_the_same(tmp_path):
    """What a GGUF load does with the float weights file once the GGUF's blocks run the linear maps."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(1 << 19)}, str(path))
    state = load_file(str(path))
    expected = float(state["a"].sum())  # every page of "a" read
    assert _mapped_rss(path) >= 4 << 20
    given = heap.give_back_file_pages([state["b"]])  # any tensor of the mapping gives back all of it
    assert given >= 4 << 20 and _mapped_rss(path) < 64 << 10
    assert float(state["a"].sum()) == expected and torch.equal(state["b"], torch.ones(1 << 19))


@pytest.mark.skipif(heap._MADVISE is None, reason="no madvise (not Linux): file pages are not given back")
def test_written_file_pages_are_never_dropped(tmp_path):
    """A private mapping's written pages exist only in this process: dropping them would undo the
    writes (a weight edited in place would silently come back as the file has it)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(1 << 20)}, str(path))
    state = load_file(str(path))
    state["a"][::1024] = 7.0  # one float a page
    assert heap.give_back_file_pages([state["a"]]) == 0
    assert float(state["a"].sum()) == 7.0 * 1024
