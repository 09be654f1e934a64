"""A disk cache of converted GGUF models, so a second load memory-maps safetensors instead of
dequantising again. An entry is complete (`WHOLE`) with every tensor in float32, or (`FLOATS`) with
only those a load on the file's own blocks (quantize="gguf") holds as floats; such a load also keeps
its repacked blocks there (`quant.ggml.packed`).

Keyed by the file's path, size, modification time and a digest of its first 16 MiB (the whole
header of any model we know) and last 1 MiB: a file rewritten within the clock's granularity (same
size, same mtime) must not load the entry of the file it replaced."""
import hashlib
import json
from pathlib import Path

from ..kernels.switches import cache_root

FORMAT = 1  # bump when the cached layout changes
_HEAD, _TAIL = 16 << 20, 1 << 20


def entry_for(path):
    """The cache folder of a GGUF file (it may not exist yet)."""
    st = Path(path).stat()
    key = json.dumps([str(Path(path).resolve()), st.st_size, st.st_mtime_ns, FORMAT, sample_digest(path, st.st_size)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{Path(path).stem}-{digest}"


def sample_digest(path, size):
    """sha256 of the first 16 MiB and the last 1 MiB (~10 ms): every byte of a small file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_HEAD))
        if size > _HEAD:
            f.seek(max(_HEAD, size - _TAIL))
            h.update(f.read(_TAIL))
    return h.hexdigest()


WHOLE, FLOATS = "done", "floats-done"  # the markers of the two kinds of complete entry


def is_complete(folder, marker=WHOLE):
    return (folder / marker).is_file()


def mark_complete(folder, marker=WHOLE):
    (folder / marker).write_text("ok")
