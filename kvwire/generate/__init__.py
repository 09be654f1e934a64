"""Generation on the cached graph: CausalLM and the decoding loop."""
from .causal_lm import CausalLM
from .loop import Generation, beam_search, sample
from .samplers import BeamSearch, Greedy, MinP, Random, Sampler, TopK, TopP

__all__ = ["BeamSearch", "CausalLM", "Generation", "Greedy", "MinP", "Random", "Sampler", "TopK", "TopP",
           "beam_search", "sample"]
