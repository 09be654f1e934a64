"""Hugging Face checkpoint folders: config.json plus single or sharded safetensors."""
from pathlib import Path

from safetensors.torch import load_file

from .tokenizer import read_json


def read_config(folder):
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; expected a Hugging Face checkpoint folder")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_state_dict(folder):
    """All tensors of `folder`'s model.safetensors, or of the shards its index lists."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        listing = read_json(index)
        weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: expected a 'weight_map' of tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{folder} has no *.safetensors files")
    state = {}
    for shard in shards:
        if Path(shard).name != shard:  # an index names files of this folder, nothing else
            raise ValueError(f"{index}: shard {shard!r} is not a file name in {folder}")
        try:  # the safetensors library checks the header against the file (offsets, sizes)
            tensors = load_file(str(folder / shard))
        except Exception as e:
            raise ValueError(f"{folder / shard} is not a readable safetensors file: {e}") from e
        twice = sorted(set(tensors) & set(state))
        if twice:
            raise ValueError(f"{folder / shard} repeats tensors of another shard: {twice[:4]}")
        state.update(tensors)
    return state
