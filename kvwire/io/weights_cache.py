"""A disk cache of converted GGUF models, so a second load memory-maps safetensors instead of
dequantising again. An entry is complete (`WHOLE`) with every tensor in float32, or (`FLOATS`) with
only those a load on the file's own blocks (quantize="gguf") holds as floats; such a load also keeps
its repacked blocks there (`quant.ggml.packed`).

Keyed by the file's path, size, modification time and a digest of its first 16 MiB (the whole
header of any model we know) and last 1 MiB: a file rewritten within the clock's granularity (same
size, same mtime) must not load the entry of the file it replaced.

An entry records the file it was made from (`SOURCE`); making a new entry removes those whose file
is gone or has changed since (`prune`): their keys can never match again, and an entry can hold
gigabytes (a 3B model's repacked blocks, or every weight in float32)."""
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..kernels.switches import cache_root

FORMAT = 1  # bump when the cached layout changes
_HEAD, _TAIL = 16 << 20, 1 << 20


def entry_for(path):
    """The cache folder of a GGUF file (it may not exist yet)."""
    st = Path(path).stat()
    key = json.dumps([str(Path(path).resolve()), st.st_size, st.st_mtime_ns, FORMAT, sample_digest(path, st.st_size)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{Path(path).stem}-{digest}"


SOURCE = "source.json"  # the file an entry was made from: its path, size and modification time


def claim(entry, path):
    """Make `entry`, the cache folder of the GGUF file at `path`, recording which file it is; then
    remove every entry superseded since (`prune`). Returns the folders removed."""
    entry.mkdir(parents=True, exist_ok=True)
    (entry / SOURCE).write_text(json.dumps(_stamp(path)))
    return prune(keep=entry)


def superseded(root=None):
    """The entries under `root` (the cache folder) whose recorded file no longer exists, or has
    another size or modification time: no load can find them again. A file on a drive that is not
    mounted counts as gone. Entries with no record (other folders, older entries) are left alone."""
    root = cache_root() if root is None else Path(root)
    found = []
    for folder in root.iterdir() if root.is_dir() else ():
        try:
            recorded = json.loads((folder / SOURCE).read_text())
        except (OSError, ValueError):
            continue
        try:
            if _stamp(recorded["path"]) != recorded:
                found.append(folder)
        except FileNotFoundError:
            found.append(folder)
        except (OSError, KeyError, TypeError):  # unreadable now, or a record we did not write: kept
            continue
    return found


def prune(root=None, keep=None):
    """Remove the `superseded` entries under `root` but `keep`; returns them. A process that maps an
    entry's files keeps its pages (removing a mapped file leaves the mapping)."""
    gone = [f for f in superseded(root) if keep is None or f != Path(keep)]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


def discard_unfinished(entry):
    """Remove `entry` unless it holds a complete conversion (either kind): what a failed conversion
    leaves (its record, maybe part of its tensors) is never read, and would be kept until its file changes."""
    if not (is_complete(Path(entry)) or is_complete(Path(entry), FLOATS)):
        shutil.rmtree(entry, ignore_errors=True)


def _stamp(path):
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


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


def weights(entry, dtype, stem="weights"):
    """The cached state dict in `dtype`, memory-mapped. Other dtypes than float32 get a file of
    their own on first use, so a bfloat16 load maps half the bytes instead of converting."""
    path = weights_path(entry, dtype, stem)
    if dtype != torch.float32 and not path.is_file():
        state = {k: v.to(dtype) for k, v in load_file(str(weights_path(entry, torch.float32, stem))).items()}
        try:
            save_file(state, str(path))
        except OSError:
            return state
    return load_file(str(path))


def weights_path(entry, dtype, stem="weights"):
    suffix = "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    return entry / f"{stem}{suffix}.safetensors"


def save_entry(entry, family, config, state, tokenizer, dtype=torch.float32, stem="weights", marker=WHOLE):
    """The float32 weights, and `dtype`'s own file when it is another (so the next load of that dtype
    maps it at once: converting from float32 there touched the whole 1 GB float32 file, a 1.9 GB peak
    for the default model in bfloat16 against 0.94 GB mapping its own file); then the config (of the
    family named `family`) and tokenizer, and `marker` last."""
    entry.mkdir(parents=True, exist_ok=True)
    tensors = {k: (torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v).float().contiguous()
               for k, v in state.items()}
    _save_file(tensors, weights_path(entry, torch.float32, stem))
    if dtype != torch.float32:
        _save_file({k: v.to(dtype) for k, v in tensors.items()}, weights_path(entry, dtype, stem))
    (entry / "config.json").write_text(json.dumps({"family": family, "config": dataclasses.asdict(config)}))
    tokenizer.save(entry)
    mark_complete(entry, marker)


def _save_file(tensors, path):
    """safetensors' save_file through a new file put in place: a model mapping the old one keeps its
    pages (truncating a mapped file would fault its next read)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
