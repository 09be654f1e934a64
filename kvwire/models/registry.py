"""Model families by name, Hugging Face `model_type` and GGUF architecture: dispatch by table."""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    """Everything kvwire needs to build and load one model family.

    config_from_hf(dict) -> config; backbone(config) -> nn.Module; head(backbone) -> head module;
    state_from_hf(state, config) / state_from_gguf(pairs, config) -> backbone state dict;
    config_from_gguf(meta, vocab, source, file) -> config (file: the `GGUFFile`, for tensor names and
    small tensors), its errors naming `source` (the file).
    `gguf_architecture` is None for a family llama.cpp writes no files of.
    """

    name: str
    hf_model_types: tuple
    gguf_architecture: str
    config_cls: type
    config_from_hf: Callable
    backbone: Callable
    head: Callable
    state_from_hf: Callable
    state_from_gguf: Callable
    config_from_gguf: Callable


FAMILIES = {}


def register(family):
    FAMILIES[family.name] = family
    return family


def by_hf_model_type(model_type):
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: {known}")


def by_gguf_architecture(arch, path=""):
    for family in FAMILIES.values():
        if family.gguf_architecture is not None and family.gguf_architecture == arch:
            return family
    known = sorted(f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)
    raise ValueError(f"GGUF {path} has architecture {arch!r}, which kvwire does not support; supported: {known}")

