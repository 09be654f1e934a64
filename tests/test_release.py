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
                current = " ".join(rest.split()[4:])  # the path, spaces and all
            elif head == "Rss:" and current == str(path):
                total += int(rest.split()[0]) * 1024
    return total


def _smaps_counts_private_pages():
    try:
        with open("/proc/self/smaps") as f:
            keys = {line.split()[0] for line in f}
    except OSError:
        return False
    return heap._OWN_PAGES <= keys


gives_back_pages = pytest.mark.skipif(
    heap._MADVISE is None or not _smaps_counts_private_pages(),
    reason="no madvise (not Linux), or no /proc/self/smaps counting a mapping's private pages: nothing is given back")


@gives_back_pages
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


@gives_back_pages
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


def test_a_smaps_without_the_private_page_counts_drops_nothing(monkeypatch, tmp_path):
    """A kernel whose smaps leaves out a mapping's Anonymous / Swap / Private_Hugetlb lines: every
    mapping is kept (unknown is never taken for clean)."""
    smaps = tmp_path / "smaps"
    smaps.write_text("7f0000000000-7f0000100000 r--p 00000000 fe:00 12 /weights.safetensors\nRss:  1024 kB\n"
                     "Anonymous:  0 kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(smaps if path == "/proc/self/smaps" else path,
                                                                          *a, **k))
    assert heap._file_mappings() == [(0x7f0000000000, 0x7f0000100000, True, 1024 * 1024)]
