"""Blocks a GGUF load had to copy (repacked for the x16 kernel, or rows picked out of order), kept on
disk in the file's cache folder and memory-mapped by the next load instead of made again: repacking
was most of a warm load's time.

One file per GGUF file, kernel layout and CPU: `blocks-<key>.bin`, where the key digests kvwire's
kernel sources (x16.c defines the repacked layout), the kernel chosen (`ggml_kernel()`) and the CPU
(vendor, model, features), so another layout or CPU never reads it. The file:

    b"KVWBLK01" | header length (8 bytes, little-endian) | header (JSON) | sha256 of the header |
    each tensor's bytes, 4096-aligned

The header holds the key, the file's size and, per weight, its offset, shape, kernel type, a digest
of the rows it holds and a sha256 of its first and last 4 KiB. A truncated file (size), a damaged
header (its digest) or damaged ends of a tensor are found on opening and the file is written again,
with a warning; a byte flipped inside a tensor is not (that check would read every byte each load).
"""
import hashlib
import json
import os
import platform
import tempfile
import warnings

import numpy as np
import torch

MAGIC = b"KVWBLK01"
FORMAT = 1  # bump when the file's layout changes
_ALIGN, _SAMPLE = 4096, 4096


class PackedBlocks:
    """The kept blocks of one GGUF file's cache folder: `get` what an earlier load kept, `put` what this
    one made, `save` when anything was made.

    Example:
        >>> store = PackedBlocks(entry)
        >>> blocks = store.get("layers.0.mlp.up_proj.weight", 1003, (3584, 1360), rows)  # None: make them
    """

    def __init__(self, folder):
        self.path = folder / f"blocks-{layout_key()[:16]}.bin"
        self.found, self.kept, self.made = _read(self.path), {}, False

    def get(self, name, kernel_type, shape, rows):
        """The (rows, row_bytes) uint8 blocks kept under `name`, memory-mapped, when they were kept with
        this kernel type, shape and row numbers (`rows`: which of the GGUF tensor's rows); else None."""
        found = self.found.get(name)
        if found is None:
            return None
        blocks, meta = found
        if (meta["kernel_type"], tuple(meta["shape"]), meta["rows"]) != (kernel_type, tuple(shape), _rows_digest(rows)):
            return None
        self.kept[name] = (blocks, kernel_type, meta["rows"])
        return blocks

    def put(self, name, blocks, kernel_type, rows):
        """Keep `blocks` (as the kernel reads them) for the next load."""
        self.kept[name] = (blocks, kernel_type, _rows_digest(rows))
        self.made = True

    def save(self):
        """Write every block kept (`get` and `put`) to the file when `put` made any, atomically; a disk that
        refuses it costs the next load the repacking, with a warning."""
        if not self.made:
            return
        try:
            _write(self.path, self.kept)
        except OSError as e:
            warnings.warn(f"kvwire: could not keep the repacked blocks in {self.path}: {e}")
        self.made = False


def layout_key():
    """A digest of what the kept bytes depend on besides the GGUF file: kvwire's kernel sources, the
    kernel chosen for the x16 formats and this CPU."""
    from ...kernels.cpu import cpuinfo_field, features_text, ggml_kernel
    from ...kernels.ggml.lib import C_SOURCES

    parts = [FORMAT, ggml_kernel(), platform.machine(), cpuinfo_field("vendor_id"), cpuinfo_field("model name"),
             features_text(), *(hashlib.sha256(path.read_bytes()).hexdigest() for path in C_SOURCES)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _rows_digest(rows):
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()[:32]


def _sample(view):
    """sha256 of the first and last 4 KiB of a tensor's bytes."""
    return hashlib.sha256(bytes(view[:_SAMPLE]) + bytes(view[-_SAMPLE:])).hexdigest()


def _write(path, kept):
    tensors, offset, arrays = {}, 0, []
    for name, (blocks, kernel_type, rows) in kept.items():
        data = blocks.contiguous().numpy()
        tensors[name] = {"offset": offset, "shape": list(data.shape), "kernel_type": kernel_type, "rows": rows,
                         "sample": _sample(memoryview(data).cast("B"))}
        arrays.append((offset, data))
        offset += -(-data.nbytes // _ALIGN) * _ALIGN
    header = {"key": layout_key(), "payload": offset, "tensors": tensors}
    text = json.dumps(header).encode()
    data_start = _data_start(len(text))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(text).to_bytes(8, "little") + text + hashlib.sha256(text).digest())
            for at, data in arrays:
                f.seek(data_start + at)
                f.write(memoryview(data).cast("B"))
            f.truncate(data_start + offset)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _data_start(header_length):
    """Where the tensors start: after the magic, the length, the header and its digest, 4096-aligned."""
    return -(-(len(MAGIC) + 8 + header_length + 32) // _ALIGN) * _ALIGN


def _read(path):
    """{name: (blocks memory-mapped, header entry)} of a sound file; {} with no file; {} and a warning
    for a damaged one."""
    if not path.is_file():
        return {}
    try:
        return _mapped(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"kvwire: {path} is damaged ({e}); its blocks are made again and the file rewritten")
        return {}


def _mapped(path):
    size = path.stat().st_size
    with open(path, "rb") as f:
        lead = f.read(len(MAGIC) + 8)
        if len(lead) < len(MAGIC) + 8 or lead[:len(MAGIC)] != MAGIC:
            raise ValueError("not a kvwire blocks file")
        length = int.from_bytes(lead[len(MAGIC):], "little")
        if length > size:
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        text, digest = f.read(length), f.read(32)
    if hashlib.sha256(text).digest() != digest:
        raise ValueError("its header does not match its digest")
    header = json.loads(text)
    if header["key"] != layout_key():
        raise ValueError("written for another kernel layout or CPU")
    data_start = _data_start(length)
    if data_start + header["payload"] != size:
        raise ValueError(f"{size} bytes where its header says {data_start + header['payload']} (truncated?)")
    data = np.memmap(path, mode="c")  # copy-on-write: pages are read when used, never written back
    found = {}
    for name, meta in header["tensors"].items():
        rows, row_bytes = meta["shape"]
        start = data_start + meta["offset"]
        if start + rows * row_bytes > size:
            raise ValueError(f"{name!r} runs past the end of the file")
        view = data[start:start + rows * row_bytes]
        if _sample(view) != meta["sample"]:
            raise ValueError(f"the bytes of {name!r} do not match their digest")
        found[name] = (torch.from_numpy(view.reshape(rows, row_bytes)), meta)
    return found
