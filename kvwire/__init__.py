"""kvwire: editable layer graphs for causal language models, with the KV cache as a graph pass.

Example:
    >>> import kvwire as kw
    >>> lm = kw.load("gemma3-270m")
    >>> lm.generate("The capital of France is", max_new_tokens=8)
"""
from .export import export, load_exported
from .generate import (BeamSearch, CausalLM, Engine, Generation, Greedy, MinP, PrefixStore, Random, RequestError, Sequence,
                       TopK, TopP)
from .graph import (CachedGraph, block_calls, clone, insert_after, insert_before, plot, replace, select, skip, tap,
                    trace, with_cache)
from .load import from_hf, load
from .quant import quantize
from .steer import SAE, Ablate, Clamp, ControlVector, Gate, Steer, patch
from .steer.capture import Capture, capture
from .graph.digest import kvwire_sources

# read now (5 ms), with the modules: kept compiled steps are keyed on the code this process runs,
# not on files edited while it runs
kvwire_sources()

__all__ = ["BeamSearch", "CachedGraph", "Capture", "CausalLM", "ControlVector", "Engine", "Generation", "Greedy", "MinP",
           "PrefixStore", "Random", "RequestError", "SAE", "Sequence", "Steer", "Ablate", "Clamp", "Gate", "TopK", "TopP", "block_calls", "capture", "clone", "export",
           "from_hf", "insert_after", "insert_before", "load", "load_exported", "patch", "plot", "quantize", "replace", "select",
           "skip", "tap", "trace", "with_cache"]
