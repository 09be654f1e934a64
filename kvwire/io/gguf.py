"""Reading GGUF files: metadata, and tensors dequantised to float32 by the `gguf` package.

The header is parsed and checked by `gguf_header` rather than with `gguf.GGUFReader`, which
builds a Python object per array element and takes ~24 s on Gemma's 262k-token vocabulary
(measured on this machine); this reader takes well under a second. Quantisation formats, type
tables and dequantisation all come from the `gguf` package.
"""
import mmap
import os

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from tqdm.auto import tqdm

from .gguf_header import GGUFError, parse, tensor_nbytes

_NUMPY = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped): `metadata`, `architecture`, `tensors()`.

    Example:
        >>> f = GGUFFile("model.gguf")
        >>> f.architecture, f.metadata["gemma3.block_count"]
        ('gemma3', 18)
    """

    def __init__(self, path):
        self.path = str(path)
        if os.path.getsize(self.path) == 0:  # np.memmap refuses empty files
            raise GGUFError(f"{self.path} is not a readable GGUF file: it is empty")
        self.data = np.memmap(self.path, mode="r")
        self._cow = None  # a copy-on-write map for `blocks`, made on first use
        try:  # a memoryview slices without copying, so strings cost what they hold
            self.metadata, self.infos = parse(memoryview(self.data))
        except GGUFError as e:
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from None

    @property
    def architecture(self):
        return self.metadata.get("general.architecture")

    def field(self, name, default=None):
        """A metadata value; arrays of 1024 or more strings (a vocabulary) come as a read-only
        `gguf_header.Strings` sequence that decodes an item when it is read (`list()` it for all)."""
        return self.metadata.get(name, default)

    @property
    def tensor_names(self):
        return [info[0] for info in self.infos]

    def tensor(self, name):
        """One tensor as a float32 numpy array (e.g. rope frequency factors a config reads)."""
        for info in self.infos:
            if info[0] == name:
                return self._tensor(*info)
        raise ValueError(f"{self.path} has no tensor {name!r}")

    def tensors(self, progress=True):
        """Yield (name, float32 numpy array in row-major (out, in) layout) for every tensor."""
        for name, dims, kind, offset in tqdm(self.infos, desc=f"dequantising {len(self.infos)} tensors",
                                             disable=not progress, leave=False):
            yield name, self._tensor(name, dims, kind, offset)

    def blocks(self, name):
        """(type, raw bytes) of one tensor: a `GGMLQuantizationType` and a (rows, row_bytes) uint8
        array mapped from the file (copy-on-write, so nothing is read until used)."""
        for tensor, dims, kind, offset in self.infos:
            if tensor == name:
                if self._cow is None:
                    self._cow = np.memmap(self.path, mode="c")
                qtype, raw = self._raw(tensor, dims, kind, offset, self._cow)
                return qtype, raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
        raise ValueError(f"{self.path} has no tensor {name!r}")

    def forget(self, array):
        """Give back this process's pages of `array`, a view `blocks()` returned whose bytes the
        caller has copied (repacked): nothing else reads them, so they need not count in its memory.
        Pages are dropped only wholly inside the array; if read again they come back from the file."""
        mapped = getattr(self._cow, "_mmap", None)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED") or not np.shares_memory(array, self._cow):
            return
        start = array.ctypes.data - self._cow.ctypes.data
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            mapped.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _raw(self, name, dims, kind, offset, data):
        """(type, the tensor's bytes shaped (*outer dims, row bytes)) for quantised types, or its
        float values shaped as the tensor for float ones."""
        nbytes = tensor_nbytes(name, dims, kind)  # checked against the file when it was opened
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        shape = list(reversed(dims))  # GGUF lists the fastest-moving dimension first
        if offset + nbytes > len(data):
            raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        raw = data[offset:offset + nbytes]
        if qtype in _NUMPY:
            return qtype, raw.view(_NUMPY[qtype]).reshape(shape)
        return qtype, raw.reshape(*shape[:-1], shape[-1] // block * size)

    def _tensor(self, name, dims, kind, offset):
        qtype, array = self._raw(name, dims, kind, offset, self.data)
        try:
            return np.require(dequantize(array, qtype), dtype=np.float32, requirements=["C", "W"])
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name!r} has type {qtype.name}, which the gguf package "
                             f"cannot dequantise") from e
