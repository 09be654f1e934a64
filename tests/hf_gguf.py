"""transformers' own GGUF loader (the arbiter for real files), with each file parsed once.

`from_pretrained(..., gguf_file=...)` builds a `gguf.GGUFReader` of the file for the config, again
for the weights, and the tokenizer twice more; a parse walks every vocabulary string and merge
through numpy memmap slices (Gemma 3's 262,144 tokens and 514,906 merges: ~8 s a parse on one core).
Sharing one reader per file changes nothing transformers computes from it.
"""
import os
from contextlib import contextmanager

import torch


@contextmanager
def one_parse_per_file():
    """Within the block, `gguf.GGUFReader(path)` returns one reader per file and mode."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def transformers_gguf(folder, name):
    """(model, tokenizer) that transformers loads from `folder/name`: float32 model in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_parse_per_file():
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return model, tokenizer
