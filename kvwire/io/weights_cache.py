"""A disk cache of converted GGUF models, so a second load memory-maps safetensors instead of
dequantising again. Keyed by the file's path, size and modification time."""
import hashlib
import json
import os
from pathlib import Path

FORMAT = 1  # bump when the cached layout changes


def cache_root():
    return Path(os.environ.get("KVWIRE_CACHE", Path.home() / ".cache" / "kvwire"))


def entry_for(path):
    """The cache folder of a GGUF file (it may not exist yet)."""
    st = Path(path).stat()
    key = json.dumps([str(Path(path).resolve()), st.st_size, st.st_mtime_ns, FORMAT])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{Path(path).stem}-{digest}"


def is_complete(folder):
    return (folder / "done").is_file()


def mark_complete(folder):
    (folder / "done").write_text("ok")
