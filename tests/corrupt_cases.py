"""Deterministic corruptions of tiny valid GGUF files, for test_corrupt_files: truncations, byte
flips, tensor infos rewritten in place, bad weights (wrong values: corrupt_configs.py).

Each case is a file (or folder) on disk and what must happen when `kw.load` reads it:
"error" (a clear ValueError naming the file), "same" (it loads, with the valid file's logits and
tokens), or "free" (either of those; or, where `may_differ`, a model that differs: a corrupted
weight value or tokenizer string cannot be told from a real one).
"""
import copy
import shutil
import struct

from .gguf_files import GGUFParts, tensor_bytes

I32, U32, F32, BOOL, U64 = 5, 4, 6, 7, 10  # GGUF value types
# GGUF keys whose corrupted value can still be a valid model: hyperparameters that size nothing
VALUE_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
              "attention.sliding_window", "context_length")
TYPES = [0, 1, 30, 2, 8, 9, 12, 26, 1000, 0xFFFFFFFF]  # F32 F16 BF16 Q4_0 Q8_0 Q8_1 Q4_K I32, unknown
HUGE = [0, 2 ** 63, 2 ** 64 - 1]


class Cases:
    """Collects cases: writes each file under `root` and records what must happen."""

    def __init__(self, root):
        self.root, self.items = root, []
        root.mkdir(parents=True, exist_ok=True)

    def add(self, prefix, data, expect, what, gguf=False, may_differ=False, match=None):
        case_id = f"{prefix}-{len(self.items):04d}"
        path = self.root / f"{case_id}.gguf"
        path.write_bytes(data)
        self.items.append(dict(id=case_id, path=str(path), control=f"{prefix}-control", expect=expect,
                               what=what, gguf=gguf, may_differ=may_differ, match=match))

    def add_folder(self, prefix, valid, edit, expect, what, match=None):
        case_id = f"{prefix}-{len(self.items):04d}"
        folder = self.root / case_id
        shutil.copytree(valid, folder)
        edit(folder)
        self.items.append(dict(id=case_id, path=str(folder), control=f"{prefix}-control", expect=expect,
                               what=what, gguf=False, may_differ=False, match=match))

    def control(self, prefix, path, gguf=False):
        self.items.append(dict(id=f"{prefix}-control", path=str(path), control=None, expect="same",
                               what="the valid file", gguf=gguf, may_differ=False, match=None))


def _poke(data, at, fmt, value):
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def edited(parts, sets=(), drops=(), alignment=None, tensors=None):
    p = copy.deepcopy(parts)
    for key in drops:
        p.drop(key)
    for key, vtype, value in sets:
        p.set(key, vtype, value)
    if tensors:
        tensors(p)
    return p.to_bytes(alignment)


_INFO = ("tname", "ndims", "dims", "ttype", "offset")  # the sections of a tensor info
_STRUCTURAL = ("general.architecture", "general.alignment")


def _may_differ(key, arch, section):
    """Whether a corrupted byte of this metadata entry can still make a valid (different) model."""
    if key.startswith("tokenizer.") or key.startswith("general.") and key not in _STRUCTURAL:
        return True  # tokenizer data and descriptions
    return section == "value" and key[len(arch) + 1:] in VALUE_KEYS


def gguf_cases(cases, arch, path):
    """Truncations, byte flips, rewritten tensor infos, metadata and weights of the GGUF at `path`."""
    p, data = GGUFParts(path), path.read_bytes()
    prefix = f"gguf-{arch}"
    cases.control(prefix, path, gguf=True)
    middle = next(t[0] for t in p.tensors if t[0].startswith("blk.1.") and t[2] == 8 and len(t[1]) == 2)
    norm = next(t[0] for t in p.tensors if t[2] == 0 and len(t[1]) == 1)
    picked = {p.tensors[0][0], middle, norm, p.tensors[-1][0]}  # tensor infos are alike: four stand for all
    _truncations(cases, prefix, p, data)
    _flips(cases, prefix, arch, p, data, picked)
    _tensor_infos(cases, prefix, p, data, picked)
    for new in (len(p.kvs) + 1, 2 ** 40, 2 ** 63):
        cases.add(prefix, _poke(data, 16, "<Q", new), "error", f"n_kv -> {new}")
        cases.add(prefix, _poke(data, 8, "<Q", new), "error", f"n_tensors -> {new}")
    _weights(cases, prefix, p, data, middle, norm)


def _truncations(cases, prefix, p, data):
    """Cut inside the header, at and just after every field, at and inside every tensor's data."""
    last_start, _ = p.region("data", p.tensors[-1][0])
    end = last_start + tensor_bytes(p.tensors[-1][1], p.tensors[-1][2])  # the final padding may go
    cuts = {0, 1, 3, 4, 7, 8, 16, 23, 24, end - 1}
    for s, e, section, _ in p.regions:
        cuts |= {s, s + 1, (s + e) // 2} if section != "data" else {s, (s + e) // 2}
    for cut in sorted(c for c in cuts if c < end):
        cases.add(prefix, data[:cut], "error", f"truncated at {cut}")


def _flips(cases, prefix, arch, p, data, picked):
    """Low and high bit flips of the first, last and inner bytes of every header field."""
    header = [r for r in p.regions if r[2] != "data" and (r[2] not in _INFO or r[3] in picked)]
    for s, e, section, name in header:
        spots = {(s, 0x01), (s, 0x80), (e - 1, 0x01), (e - 1, 0x80)}
        spots |= {(s + (e - s) * k // 4, 0x01) for k in (1, 2, 3)} if e - s > 8 else set()
        for at, mask in sorted(spots):
            flipped = bytearray(data)
            flipped[at] ^= mask
            differ = section in ("key", "vtype", "value") and _may_differ(name, arch, section)
            cases.add(prefix, bytes(flipped), "free", f"byte {at} ({section} {name}) ^ {mask:#x}",
                      gguf=section in _INFO, may_differ=differ)


def _tensor_infos(cases, prefix, p, data, picked):
    """Types, dimensions, dimension counts, offsets and names rewritten in place."""
    names = [t[0] for t in p.tensors]
    offsets = [struct.unpack("<Q", data[s:e])[0] for s, e, sec, _ in p.regions if sec == "offset"]
    for name, dims, kind, _ in [t for t in p.tensors if t[0] in picked]:
        at = p.region("ttype", name)[0]
        for new in (t for t in TYPES if t != kind):
            cases.add(prefix, _poke(data, at, "<I", new), "error", f"{name} type {kind} -> {new}", gguf=True)
        s, _ = p.region("dims", name)
        for i in {0, len(dims) - 1}:
            for new in {dims[i] + 1, dims[i] * 2, max(dims[i] // 2, 1), *HUGE} - {dims[i]}:
                cases.add(prefix, _poke(data, s + 8 * i, "<Q", new), "error", f"{name} dims[{i}] -> {new}",
                          gguf=True)
        if len(dims) == 2:  # swapped: a square matrix reads the same bytes as before
            swapped = _poke(_poke(data, s, "<Q", dims[1]), s + 8, "<Q", dims[0])
            cases.add(prefix, swapped, "free" if dims[0] == dims[1] else "error", f"{name} dims swapped", gguf=True)
        for new in (0, 3, 5, 0xFFFFFFFF):
            cases.add(prefix, _poke(data, p.region("ndims", name)[0], "<I", new), "error", f"{name} n_dims -> {new}")
        at, offset, step = p.region("offset", name)[0], offsets[names.index(name)], p.alignment
        for new in {offset + 1, offset + step, max(offset - step, 0), offsets[1], offsets[-1], *HUGE[1:]} - {offset}:
            cases.add(prefix, _poke(data, at, "<Q", new), "error", f"{name} offset -> {new}", gguf=True)
    for old, new in [("blk.0.", "blk.1."), ("blk.0.", "blk.9."), ("_norm.", "_nprm.")]:
        name = next(n for n in names if old in n)
        s, e = p.region("tname", name)
        renamed = data[:s + 8] + data[s + 8:e].replace(old.encode(), new.encode(), 1) + data[e:]
        cases.add(prefix, renamed, "error", f"tensor {name} renamed with {new}")


def _weights(cases, prefix, p, data, middle, norm):
    """NaN and infinity (detectable), other values (not), and ggml's kernels on them."""
    s, _ = p.region("data", norm)
    cases.add(prefix, _poke(data, s, "<f", float("nan")), "error", f"NaN in {norm}", match="NaN or infinite")
    s, _ = p.region("data", middle)
    cases.add(prefix, _poke(data, s, "<H", 0x7C00), "error", f"an infinite Q8_0 scale in {middle}", gguf=True)
    for name in [t[0] for t in p.tensors if t[2] == 8][:12]:
        s, e = p.region("data", name)
        for at in (s + 1, (s + e) // 2):
            flipped = bytearray(data)
            flipped[at] ^= 0x10
            cases.add(prefix, bytes(flipped), "free", f"data byte {at} of {name}", gguf=True, may_differ=True)
