"""Control vectors as GGUF files, in llama.cpp's format (what `llama-cli --control-vector` reads).

Layout: `general.architecture = "controlvector"`, `controlvector.model_hint` (str),
`controlvector.layer_count` (uint32), and one 1-D F32 tensor `direction.N` per steered block,
N >= 1, added to the output of block N (0-based). llama.cpp rejects `direction.0`.
Writing uses the `gguf` package; reading uses kvwire's GGUF reader.
"""
import re
from pathlib import Path

import numpy as np
import torch

ARCH = "controlvector"
_NAME = re.compile(r"^direction\.(\d+)$")


def save_control_vector(directions, model_hint, path):
    """Write `directions` ({block: (D,) tensor}) to `path` as a llama.cpp GGUF control vector."""
    import gguf

    if 0 in directions:
        raise ValueError("block 0 cannot be saved: llama.cpp's control-vector format numbers directions "
                         "from 1 (direction.N steers the output of block N); train with layers >= 1")
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_string(f"{ARCH}.model_hint", model_hint or "")
    writer.add_uint32(f"{ARCH}.layer_count", len(directions))
    for i, v in directions.items():
        writer.add_tensor(f"direction.{i}", v.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_control_vector(path):
    """Read a GGUF control vector: ({block: (D,) float32 tensor} in llama.cpp's numbering, model hint)."""
    from ..io.gguf import GGUFFile

    if not Path(path).is_file():
        raise FileNotFoundError(f"no control-vector file at {path}")
    f = GGUFFile(path)
    if f.architecture != ARCH:
        raise ValueError(f"{path} is not a control vector: its GGUF architecture is {f.architecture!r}, "
                         f"expected {ARCH!r}")
    directions = {}
    for name, array in f.tensors(progress=False):
        m = _NAME.match(name)
        if not m or int(m.group(1)) == 0 or array.ndim != 1:
            raise ValueError(f"{path}: tensor {name!r} of shape {array.shape} is not a control-vector "
                             f"direction (expected 1-D tensors named direction.N, N >= 1)")
        directions[int(m.group(1))] = torch.from_numpy(np.array(array, dtype=np.float32))
    if not directions:
        raise ValueError(f"{path}: control vector has no direction tensors")
    return directions, str(f.field(f"{ARCH}.model_hint", "") or "")
