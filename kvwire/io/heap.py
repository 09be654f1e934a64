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
    """Give back the pages this process holds of the files memory-mapped under `tensors` (they are
    read again from the file if needed): for a file of which little is read from now on, such as
    the float weights file a GGUF load maps for its norms and embedding rows once its linear maps
    run on the GGUF's own blocks. Merely making Gemma 3's 236 float tensors from that file
    (safetensors' `load_file`) left 8 MB of it in the process. A mapping with pages this process has
    written is left alone (those pages exist nowhere else). Elsewhere (not Linux) nothing is done.
    Returns the bytes given back."""
    maps = _file_mappings() if _MADVISE is not None else []
    ptrs = [t.data_ptr() for t in tensors if t.numel()]
    given = 0
    for start, end, written, resident in maps:
        if not written and any(start <= p < end for p in ptrs) and \
                _MADVISE(start, end - start, mmap.MADV_DONTNEED) == 0:
            given += resident
    return given


def _file_mappings():
    """[(start, end, has written pages, resident bytes)] of this process's file-backed mappings."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    maps, current = [], None
    for line in lines:
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # "start-end perms offset dev inode [path]"
            fields = rest.split()
            named = len(fields) >= 5 and fields[4].startswith("/")
            a, b = (int(x, 16) for x in head.split("-"))
            current = [a, b, False, 0] if named else None
            if current is not None:
                maps.append(current)
        elif current is not None and head == "Rss:":
            current[3] = int(rest.split()[0]) * 1024
        elif current is not None and head == "Anonymous:" and int(rest.split()[0]):
            current[2] = True
    return [tuple(m) for m in maps]


def _madvise_function():
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_MADVISE = _madvise_function()
