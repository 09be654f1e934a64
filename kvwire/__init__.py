"""kvwire: editable layer graphs for causal language models, with the KV cache as a graph pass.

Example:
    >>> import kvwire as kw
    >>> lm = kw.load("gemma3-270m")
    >>> lm.generate("The capital of France is", max_new_tokens=8)
"""
from .generate import BeamSearch, CausalLM, Generation, Greedy, MinP, Random, TopK, TopP
from .graph import CachedGraph, clone, trace, with_cache
from .load import from_hf, load

__all__ = ["BeamSearch", "CachedGraph", "CausalLM", "Generation", "Greedy", "MinP", "Random", "TopK", "TopP",
           "clone", "from_hf", "load", "trace", "with_cache"]
