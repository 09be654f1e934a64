"""Graph passes over torch.fx: trace, clone (and ready-made edits), tap, with_cache, plot."""
from .cache import CachedGraph, with_cache
from .clone import clone, current_call
from .draw import plot
from .edit import block_calls, insert_after, insert_before, numbered_blocks, replace, select, skip
from .sites import site_calls
from .tap import tap
from .trace import trace

__all__ = ["CachedGraph", "block_calls", "clone", "current_call", "insert_after", "insert_before", "numbered_blocks", "plot",
           "replace",
           "select", "site_calls", "skip", "tap", "trace", "with_cache"]
