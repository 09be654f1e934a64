"""Give memory back to the operating system: the heap's freed pages (glibc's `malloc_trim`) and
the pages of memory-mapped files that are no longer read (`madvise`).

Reading a large tokenizer makes and frees hundreds of megabytes of small strings: Gemma 3's
tokenizer.json (262,144 tokens, 514,906 merges) leaves a process 304 MB larger, of which 203 MB is
memory `tokenizers` already freed and glibc keeps (measured: +304 MB after
`tokenizers.Tokenizer.from_file`, +101 MB after `malloc_trim(0)`, which took 20 ms). Elsewhere
(musl, macOS) there is no such call and nothing is done.
"""
import ctypes
import ctypes.util
import mmap
import sys


def _trim_function():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _trim_function()


def give_back_freed_memory():
    """Return the heap's free pages to the OS where glibc can; True if it released any."""
    return bool(_TRIM(0)) if _TRIM is not None else False


def give_back_file_pages(tensors):
    """Give back the pages this process holds of the files memory-mapped under `tensors` (CPU tensors;
    read again from the file if needed). For a file little of which is read from now on: the float
    weights a GGUF load maps for its norms once its linear maps, head and embedding run on the
    GGUF's blocks (safetensors' `load_file` alone left 8 MiB of Gemma 3's in the process). A mapping
    is dropped only when smaps shows it holds no page of this process's own (written, or swapped
    out): those exist nowhere else. Call it before anything may write the tensors (a load does): a
    write between the check and the drop would be lost. Elsewhere (not Linux) nothing is done.
    Returns the resident bytes of the mappings dropped."""
    ptrs = [t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()]
    maps = _file_mappings() if _MADVISE is not None and ptrs else []
    return sum(resident for start, end, own, resident in maps
               if not own and any(start <= p < end for p in ptrs) and _drop(start, end))


def _drop(start, end):
    return _MADVISE(start, end - start, mmap.MADV_DONTNEED) == 0


def _file_mappings():
    """[(start, end, holds pages of its own, resident bytes)] of this process's file-backed mappings.
    A mapping counts as holding its own pages unless smaps says it has none (Anonymous, Swap and
    Private_Hugetlb all 0 kB): a kernel that leaves those lines out gets nothing dropped."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    maps, current = [], None
    for line in lines:
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # "start-end perms offset dev inode [path]"
            fields, current = rest.split(), None
            if len(fields) >= 5 and fields[4].startswith("/"):
                current = {"span": tuple(int(x, 16) for x in head.split("-")), "resident": 0, "clean": set()}
                maps.append(current)
        elif current is not None and head == "Rss:":
            current["resident"] = int(rest.split()[0]) * 1024
        elif current is not None and head in _OWN_PAGES and int(rest.split()[0]) == 0:
            current["clean"].add(head)
    return [(*m["span"], m["clean"] != _OWN_PAGES, m["resident"]) for m in maps]


_OWN_PAGES = {"Anonymous:", "Swap:", "Private_Hugetlb:"}  # smaps lines counting a mapping's private pages


def _madvise_function():
    """libc's madvise (ctypes), or None off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_MADVISE = _madvise_function()
