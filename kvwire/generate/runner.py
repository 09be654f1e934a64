"""The narrow interface between a model and the loops that run it (the engine, beam search).

A loop needs a cached graph to call, a head, where tensors live and a few limits; it never reads
a model's other attributes. `CausalLM.runner()` and `ExportedLM.runner()` build one.
"""
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .pool import CachePool


@dataclass(frozen=True)
class Runner:
    """What one generation call runs on.

    Attributes:
        graph: the cached graph: `graph(ids (B, T), positions (B, T), cache_index, mask (B, S),
            cache, **inputs) -> (hidden or logits, next cache)`, with `init_cache`,
            `default_inputs`, `runtime_inputs`, `runtime_values`, `check_call`, `slots`,
            `row_index` (True when it takes one write index per row).
        head: hidden (B, D) -> logits (B, V) (identity when the graph gives logits).
        vocab_size: V. device: where the step's tensors are made.
        max_context: the model's context in tokens (None: unbounded).
        tokenizer: for stop strings (None: the model has none). eos_token_ids: ids that end a row.
        decode: a compiled step (`CompiledDecode`) for one-token steps and short prompts, or None.
        prefill_call_tokens: prompt tokens a prefill call runs at most (None: the default).
        cache_length: the timeline a call of `max_length` tokens gets (compiled steps round it up;
            an exported program has one fixed length).
        multiple: `multiple(longest_prompt, max_length)`: pad prompts to a multiple of this.
        pool: idle caches kept between calls.

    Example:
        >>> runner = lm.runner()
        >>> runner.graph.init_cache(2, runner.cache_length(64))
    """

    graph: Any
    head: Callable
    vocab_size: int
    device: torch.device = torch.device("cpu")
    max_context: int = None
    tokenizer: Any = None
    eos_token_ids: tuple = ()
    decode: Any = None
    prefill_call_tokens: int = None
    cache_length: Callable = None
    multiple: Callable = None
    pool: CachePool = field(default_factory=CachePool)

    def __post_init__(self):
        if self.cache_length is None:
            object.__setattr__(self, "cache_length", lambda n: n)
        if self.multiple is None:
            object.__setattr__(self, "multiple", lambda longest, n: 1)
