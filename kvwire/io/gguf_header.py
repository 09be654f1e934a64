"""Parsing a GGUF header (metadata, tensor infos) and checking that every tensor fits the file.

Every count, length and offset is checked against the bytes that are there before it is used, so
a truncated, corrupt or hostile file fails with a `GGUFError` saying what is wrong, never with a
struct/index/memory error, a huge allocation or a read past the end. The layout rule is
llama.cpp's (gguf.cpp): each tensor starts where the previous one ends, padded to
`general.alignment`. kvwire also wants the padding zero (as every writer leaves it) and nothing
after the last tensor: that is where a tensor shrunk by a rewritten type or dimension, or a
lowered tensor count, would otherwise go unnoticed and load as wrong values.
"""
import math
import struct
from collections.abc import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAX_DIMS = 4  # GGML_MAX_DIMS
LAZY_STRINGS = 1024  # string arrays this long are decoded when read (`Strings`)
_U64 = struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# the fewest bytes a metadata entry (empty key, type, one byte) and a tensor info (empty name,
# one dimension, type, offset) can take: a count that needs more than the file holds is corrupt
_MIN_KV, _MIN_INFO = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


class Strings(Sequence):
    """A GGUF array of strings, decoded (UTF-8, bad bytes replaced) when an item is read.
    `starts[i]` is where string i begins in `buf`; string i ends 8 bytes before `starts[i + 1]`."""

    def __init__(self, buf, starts):
        self.buf, self.starts = buf, starts

    def __len__(self):
        return len(self.starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"string index {i} out of range for {n} strings")
        i %= n
        a, b = int(self.starts[i]), int(self.starts[i + 1]) - 8
        return bytes(self.buf[a:b]).decode("utf-8", errors="replace")

    def __eq__(self, other):
        return isinstance(other, (list, Strings)) and len(other) == len(self) and all(
            a == b for a, b in zip(self, other))

    def __repr__(self):
        return f"Strings({len(self)} strings)"


class GGUFError(ValueError):
    """A file that cannot be read as GGUF: truncated, corrupt, or laid out inconsistently."""


class _Cursor:
    """Reads little-endian fields from a buffer, checking each against the bytes left."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def need(self, n, what):
        if n > len(self.buf) - self.pos:
            raise GGUFError(f"{what} needs {n} bytes at offset {self.pos}, but the file ends at "
                            f"{len(self.buf)} (truncated?)")

    def unpack(self, fmt, what):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what):
        n = self.unpack("<Q", what)
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, n, what):
        """n strings as `Strings`: their lengths are walked and checked now, their text decoded
        when read (a vocabulary's 262k tokens: ~0.2 s a load, most loads never read them)."""
        buf, pos, size, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        starts = np.empty(n + 1, dtype=np.int64)
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            m = length(buf, pos)[0]
            if m > size - pos - 8:
                self.pos = pos + 8
                self.need(m, what)
            starts[i] = pos + 8
            pos += 8 + m
        starts[n] = pos + 8  # where a string after the last would begin: its end + its length field
        self.pos = pos
        return Strings(buf, starts)

    def value(self, kind, what):
        kind = _value_type(kind, what)
        if kind == GGUFValueType.STRING:
            return self.string(what)
        if kind != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[kind], what)
        item, n = _value_type(self.unpack("<I", what), what), self.unpack("<Q", what)
        if item == GGUFValueType.ARRAY:  # llama.cpp refuses them too
            raise GGUFError(f"{what} is an array of arrays, which GGUF readers do not support")
        if item == GGUFValueType.STRING:
            self.need(8 * n, f"{what} ({n} strings)")  # every string has an 8-byte length
            if n < LAZY_STRINGS:
                return [self.string(what) for _ in range(n)]
            return self.strings(n, what)
        dtype = np.dtype(_SCALARS[item])
        self.need(dtype.itemsize * n, f"{what} ({n} values)")
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist() if n else []
        self.pos += dtype.itemsize * n
        return values


def _value_type(kind, what):
    try:
        return GGUFValueType(kind)
    except ValueError:
        raise GGUFError(f"{what} has unknown GGUF value type {kind}") from None


def parse(buf):
    """(metadata dict, tensor infos [(name, dims, ggml type id, absolute offset)]) of the bytes
    of a whole GGUF file (a buffer: bytes, memoryview), every tensor checked to fit."""
    c = _Cursor(buf)
    c.need(4, "the magic number")
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFError(f"bad magic {bytes(buf[:4])!r}; expected b'GGUF'")
    c.pos = 4
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors, n_kv = c.unpack("<Q", "the tensor count"), c.unpack("<Q", "the metadata count")
    c.need(n_kv * _MIN_KV + n_tensors * _MIN_INFO, f"{n_kv} metadata entries and {n_tensors} tensor infos")
    metadata = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if key in metadata:
            raise GGUFError(f"metadata key {key!r} appears twice")
        metadata[key] = c.value(c.unpack("<I", f"the type of {key!r}"), f"the value of {key!r}")
    infos, names = [], set()
    for i in range(n_tensors):
        name = c.string(f"the name of tensor {i}")
        if name in names:
            raise GGUFError(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = c.unpack("<I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions; expected 1 to {MAX_DIMS}")
        dims = [c.unpack("<Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        kind = c.unpack("<I", f"the type of tensor {name!r}")
        infos.append((name, dims, kind, c.unpack("<Q", f"the offset of tensor {name!r}")))
    alignment = _alignment(metadata)
    start = -(-c.pos // alignment) * alignment  # the data section begins at the next aligned byte
    if infos and start > len(buf):
        raise GGUFError(f"general.alignment = {alignment} puts the tensor data at {start}, past the end of "
                        f"the file at {len(buf)}")
    return metadata, _layout(infos, start, alignment, buf)


def _alignment(metadata):
    a = metadata.get("general.alignment", 32)
    if type(a) is not int or a <= 0 or a & (a - 1):
        raise GGUFError(f"general.alignment = {a!r} is not a positive power of two (the default is 32)")
    return a


def tensor_nbytes(name, dims, kind):
    """Bytes of a tensor of `dims` (fastest-moving first) in ggml type `kind`, after checking
    that the type is known and its rows are whole blocks."""
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise GGUFError(f"tensor {name!r} has unknown ggml type id {kind}") from None
    block, size = GGML_QUANT_SIZES[qtype]
    if min(dims) < 1:
        raise GGUFError(f"tensor {name!r} has dimensions {dims}; every dimension must be at least 1")
    if dims[0] % block:
        raise GGUFError(f"tensor {name!r} has rows of {dims[0]} values, not a whole number of "
                        f"{qtype.name} blocks ({block} values each)")
    return math.prod(dims) // block * size  # Python integers: no overflow on hostile dimensions


def _layout(infos, start, alignment, buf):
    """Infos with absolute offsets, after checking llama.cpp's layout against the file's bytes."""
    out, expected, size = [], 0, len(buf)
    for name, dims, kind, offset in infos:
        nbytes = tensor_nbytes(name, dims, kind)
        if offset % alignment:
            raise GGUFError(f"tensor {name!r} has offset {offset}, not a multiple of general.alignment "
                            f"({alignment})")
        if offset != expected:
            raise GGUFError(f"tensor {name!r} has offset {offset}, expected {expected} (where the previous "
                            f"tensor ends): tensors overlap, leave a gap, or a size is wrong")
        if start + offset + nbytes > size:
            raise GGUFError(f"tensor {name!r} ({nbytes} bytes at {start + offset}) runs past the end of the "
                            f"file at {size} (truncated?)")
        out.append((name, dims, kind, start + offset))
        expected = offset + -(-nbytes // alignment) * alignment
        padding = bytes(buf[start + offset + nbytes:min(start + expected, size)])
        if padding.count(0) != len(padding):
            raise GGUFError(f"the padding after tensor {name!r} (bytes {start + offset + nbytes} to "
                            f"{start + expected}) is not zero: its type or dimensions are wrong")
    if out and size > start + expected:
        raise GGUFError(f"{size - start - expected} bytes follow the last tensor (which ends at "
                        f"{start + expected}): a tensor's type or dimensions, or the tensor count, are wrong")
    return out
