"""Generation on the cached graph: CausalLM and the decoding loop."""
from .causal_lm import CausalLM
from .loop import Generation, greedy

__all__ = ["CausalLM", "Generation", "greedy"]
