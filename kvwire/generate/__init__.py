"""Generation on the cached graph: CausalLM, the engine (one decoding loop), samplers, beam search."""
from .causal_lm import CausalLM
from .engine import Engine, Sequence
from .loop import Generation, beam_search
from .prefix import PrefixStore
from .request import RequestError
from .runner import Runner
from .samplers import BeamSearch, Greedy, MinP, Random, Sampler, TopK, TopP

__all__ = ["BeamSearch", "CausalLM", "Engine", "Generation", "Greedy", "MinP", "PrefixStore", "Random", "RequestError",
           "Runner", "Sampler", "Sequence", "TopK", "TopP", "beam_search"]
