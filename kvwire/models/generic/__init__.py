"""The generic path: any transformers decoder-only causal LM as a kvwire layer graph, built from
transformers' own modules with no per-family code (see `build.from_transformers`)."""
from .build import from_transformers

__all__ = ["from_transformers"]
