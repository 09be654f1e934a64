"""Hugging Face checkpoint folders: config.json plus single or sharded safetensors."""
import json
from pathlib import Path

from safetensors.torch import load_file


def read_config(folder):
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; expected a Hugging Face checkpoint folder")
    return json.loads(path.read_text())


def read_state_dict(folder):
    """All tensors of `folder`'s model.safetensors, or of the shards its index lists."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{folder} has no *.safetensors files")
    state = {}
    for shard in shards:
        try:
            state.update(load_file(str(folder / shard)))
        except Exception as e:
            raise ValueError(f"{folder / shard} is not a readable safetensors file: {e}") from e
    return state
