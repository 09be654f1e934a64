"""Graph passes over torch.fx: trace, clone, with_cache."""
from .cache import CachedGraph, with_cache
from .clone import clone
from .trace import trace

__all__ = ["CachedGraph", "clone", "trace", "with_cache"]
