"""kvwire: editable layer graphs for causal LMs, with the KV cache as a graph pass."""
from .graph import CachedGraph, clone, trace, with_cache
