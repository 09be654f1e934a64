"""Control vectors as GGUF files, in llama.cpp's format (what `llama-cli --control-vector` reads),
with kvwire's own keys saying what the vector is.

llama.cpp's layout: `general.architecture = "controlvector"`, `controlvector.model_hint` (str),
`controlvector.layer_count` (uint32), and one 1-D F32 tensor `direction.N` per steered block,
N >= 1, added to the output of block N (blocks counted from 0, as in the checkpoint).
llama.cpp rejects `direction.0`, and reads no other keys.

kvwire adds keys under `kvwire.` (llama.cpp ignores unknown keys):
- `kvwire.operation`: "add", "ablate" or "clamp"; `kvwire.site`: one of `kvwire.layers.site.SITES`;
- `kvwire.layer_numbering`: `NUMBERING`; `kvwire.method`: how it was trained (absent: unknown);
- `kvwire.strength` (float32): the recommended strength, e.g. `kw.steer.calibrate`'s choice (absent: none);
- `kvwire.model.<field>` for each field of the training model's fingerprint
  (`kvwire.steer.fingerprint`: architecture, hidden_size, num_layers, vocab_size, tokenizer).
A file without them is a llama.cpp vector: added at block_out, no fingerprint.

Only an added block_out vector is what llama.cpp would apply correctly. Any other is written with
tensors named `kvwire.direction.N` (which may include block 0), which llama.cpp refuses to load
("invalid/unparsable direction tensor layer index") instead of adding it at the wrong place.
Writing uses the `gguf` package; reading uses kvwire's GGUF reader.
"""
import re
from pathlib import Path

import numpy as np
import torch

from ..layers.site import ALL_SITES as SITES
from .fingerprint import FIELDS

ARCH = "controlvector"
OPERATIONS = ("add", "ablate", "clamp")
NUMBERING = "direction.N acts at the site of block N; blocks are counted from 0 in checkpoint order (llama.cpp's)"
_NAME = re.compile(r"^(kvwire\.)?direction\.(\d+)$")
_INT_FIELDS = ("hidden_size", "num_layers", "vocab_size")


def llama_cpp_readable(operation, site):
    """Whether llama.cpp applies a vector of this operation at this site as kvwire does."""
    return operation == "add" and site == "block_out"


def save_control_vector(directions, model_hint, path, *, operation="add", site="block_out", method="",
                        fingerprint=None, strength=None):
    """Write `directions` ({block: (D,) tensor}) to `path` as a GGUF control vector (see the module)."""
    import gguf

    plain = llama_cpp_readable(operation, site)
    if plain and 0 in directions:
        raise ValueError("block 0 cannot be saved: llama.cpp's control-vector format numbers directions "
                         "from 1 (direction.N steers the output of block N); train with layers >= 1")
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_string(f"{ARCH}.model_hint", model_hint or "")
    writer.add_uint32(f"{ARCH}.layer_count", len(directions))
    writer.add_string("kvwire.operation", operation)
    writer.add_string("kvwire.site", site)
    writer.add_string("kvwire.layer_numbering", NUMBERING)
    if method:
        writer.add_string("kvwire.method", method)
    if strength is not None:
        writer.add_float32("kvwire.strength", float(strength))
    for key, value in (fingerprint or {}).items():
        if key in _INT_FIELDS:
            writer.add_uint32(f"kvwire.model.{key}", int(value))
        else:
            writer.add_string(f"kvwire.model.{key}", str(value))
    prefix = "" if plain else "kvwire."
    for i, v in directions.items():
        writer.add_tensor(f"{prefix}direction.{i}", v.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_control_vector(path):
    """Read a GGUF control vector: {"directions": {block: (D,) float32 tensor} (llama.cpp's numbering),
    "model_hint", "operation", "site", "method", "fingerprint" (dict or None), "strength" (float or None)}."""
    from ..io.gguf import GGUFFile

    if not Path(path).is_file():
        raise FileNotFoundError(f"no control-vector file at {path}")
    f = GGUFFile(path)
    if f.architecture != ARCH:
        raise ValueError(f"{path} is not a control vector: its GGUF architecture is {f.architecture!r}, "
                         f"expected {ARCH!r}")
    numbering = f.field("kvwire.layer_numbering", NUMBERING)
    if numbering != NUMBERING:
        raise ValueError(f"{path}: unknown layer numbering {numbering!r}; this kvwire reads {NUMBERING!r}")
    meta = {"operation": str(f.field("kvwire.operation", "add")), "site": str(f.field("kvwire.site", "block_out"))}
    for key, allowed in (("operation", OPERATIONS), ("site", SITES)):
        if meta[key] not in allowed:
            raise ValueError(f"{path}: kvwire.{key} is {meta[key]!r}, expected one of {allowed}")
    directions = {}
    for name, array in f.tensors(progress=False):
        m = _NAME.match(name)
        if not m or (not m.group(1) and int(m.group(2)) == 0) or array.ndim != 1 or int(m.group(2)) in directions:
            raise ValueError(f"{path}: tensor {name!r} of shape {array.shape} is not a control-vector "
                             f"direction (expected 1-D tensors named direction.N, N >= 1, each N once)")
        directions[int(m.group(2))] = torch.from_numpy(np.array(array, dtype=np.float32))
    if not directions:
        raise ValueError(f"{path}: control vector has no direction tensors")
    found = {k: f.field(f"kvwire.model.{k}") for k in FIELDS}
    fingerprint = {k: (int(v) if k in _INT_FIELDS else str(v)) for k, v in found.items() if v is not None}
    strength = f.field("kvwire.strength")
    return {"directions": directions, "model_hint": str(f.field(f"{ARCH}.model_hint", "") or ""),
            "method": str(f.field("kvwire.method", "") or ""), "fingerprint": fingerprint or None,
            "strength": None if strength is None else float(strength), **meta}
