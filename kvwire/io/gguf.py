"""Reading GGUF files: metadata, and tensors dequantised to float32 by the `gguf` package.

The header is parsed here rather than with `gguf.GGUFReader`, which builds a Python object per
array element and takes ~24 s on Gemma's 262k-token vocabulary (measured on this machine); this
reader takes well under a second. Quantisation formats, type tables and dequantisation all come
from the `gguf` package.
"""
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from tqdm.auto import tqdm

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
_HEADER_GUESS = 64 << 20


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self):
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the header")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind):
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, n = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if item in _SCALARS:  # numeric arrays are read in one go
                dtype = np.dtype(_SCALARS[item])
                if self.pos + dtype.itemsize * n > len(self.buf):
                    raise struct.error("array runs past the end of the header")
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += dtype.itemsize * n
                return arr.tolist()
            if item == GGUFValueType.STRING:
                return [self.string() for _ in range(n)]
            return [self.value(item) for _ in range(n)]
        return self.unpack(_SCALARS[kind])


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped): `metadata`, `architecture`, `tensors()`.

    Example:
        >>> f = GGUFFile("model.gguf")
        >>> f.architecture, f.metadata["gemma3.block_count"]
        ('gemma3', 18)
    """

    def __init__(self, path):
        self.path = str(path)
        self.data = np.memmap(self.path, mode="r")
        self._cow = None  # a copy-on-write map for `blocks`, made on first use
        # Parse from plain bytes (slicing a memmap makes an array per string): the first 64 MiB
        # hold the header of any model we know; a longer header is retried on the whole file.
        try:
            try:
                self.metadata, self.infos = self._parse(bytes(self.data[:_HEADER_GUESS]))
            except (struct.error, IndexError):
                if len(self.data) <= _HEADER_GUESS:
                    raise
                self.metadata, self.infos = self._parse(bytes(self.data))
        except (struct.error, ValueError, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file (truncated or corrupt?): {e}") from e

    def _parse(self, header):
        c = _Cursor(header)
        if len(header) < 4 or header[:4] != b"GGUF":
            raise ValueError("bad magic; expected b'GGUF'")
        c.pos = 4
        version, n_tensors, n_kv = c.unpack("<I"), c.unpack("<Q"), c.unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (expected 2 or 3)")
        metadata = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            infos.append((name, dims, c.unpack("<I"), c.unpack("<Q")))
        align = metadata.get("general.alignment", 32)
        start = (c.pos + align - 1) // align * align
        return metadata, [(n, d, t, start + o) for n, d, t, o in infos]

    @property
    def architecture(self):
        return self.metadata.get("general.architecture")

    def field(self, name, default=None):
        return self.metadata.get(name, default)

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
        raise KeyError(f"{self.path} has no tensor {name!r}")

    def _raw(self, name, dims, kind, offset, data):
        """(type, the tensor's bytes shaped (*outer dims, row bytes)) for quantised types, or its
        float values shaped as the tensor for float ones."""
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type id {kind}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        shape = list(reversed(dims))  # GGUF lists the fastest-moving dimension first
        nbytes = int(np.prod(dims)) // block * size
        if offset + nbytes > len(data):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
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
