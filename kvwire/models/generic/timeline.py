"""Where kvwire's cache meets decoder layers that compute attention themselves (ALiBi, learned
position biases, hand-written masks): layers that hand their keys and values to transformers'
Cache API (`cache.update`) and attend over what it returns, not through the attention interface.

Such a layer reads more than keys and values: masks and position biases the model's forward
computes for the whole key length (Bloom's ALiBi from the padding mask's running count, MPT's
ALiBi and GPT-Neo's local band by key column). So in a cached call the prelude runs the model's
forward as transformers runs it with a cache (`timeline_cache`) and a 2D padding mask over

    columns = [the cache's S slots, right-aligned] + [the chunk's T tokens]

with the chunk last: query t is column S + t, and old column c holds absolute index
cache_index - S + c (`aligned`), so a column's distance from a query is its distance in the
sequence and every mask and bias the forward builds by column or by count is right for each row,
whatever its own cache_index. The layer's `update(key, value)` returns the cache's keys/values in
that order followed by the chunk's, and the chunk is written into kvwire's cache (`handing`).
Absolute indices before a row's start are invalid columns of the padding mask. The cache reports
S past tokens (the columns before the chunk): right for the masks' sizes, but not a row's position,
so a model whose layers compute with that number (Llama 4's attention temperature) is refused by
the build (`shifted`).

Attention modules that do call the interface but compute with what the cache returns first (Doge's
mask from the cached values) take the same route: the build tries it where the interface route
fails its checks, and the interface then runs the module's eager attention as it is called.

The cache holds max_length slots (no ring): the columns are re-ordered per step (a gather), which
costs a copy of the layer's keys and values each step.
"""
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...layers.attention import write_chunk
from ...layers.masks import per_row
from .scoped import Scoped

_active = Scoped(None)
_shift = Scoped(0)


@dataclass
class Handing:
    """One cached call of a layer that attends through the Cache API: its cache pair (B, H, S, d),
    the call's cache_index () or (B,), its sparse-attention indexer's key slot pair ((B, 1, S, k),
    or None), and how many `update` and `update_indexer` calls it made."""

    cache: tuple
    cache_index: torch.Tensor
    indexer: tuple = None
    calls: int = 0
    indexer_calls: int = 0


@contextmanager
def handing(state):
    """Inside: a timeline cache's `update` reads and writes `state` (a `Handing`)."""
    token = _active.set(state)
    try:
        yield state
    finally:
        _active.reset(token)


@contextmanager
def shifted(by):
    """Inside: the past length a timeline cache reports to a decoder layer's own call is `by`
    larger (the build's check that no layer computes with it: kvwire's rows each stand at their
    own position, which one number for the batch cannot say)."""
    token = _shift.set(by)
    try:
        yield
    finally:
        _shift.reset(token)


def aligned(cache_index, slots):
    """(index, held): for each of the `slots` columns before a chunk, the slot it reads and the
    absolute index it holds (negative: before the sequence); (slots,) or (B, slots) per row."""
    c = torch.arange(slots, device=cache_index.device)
    held = (cache_index[:, None] if per_row(cache_index) else cache_index) - slots + c
    return torch.remainder(held, slots), held


def padding_mask(cache_index, T, attention_mask):
    """The 2D padding mask (B, S + T) of int64 over the columns (module docstring): old columns
    valid where they hold a written, non-pad index, chunk columns where the token is not a pad."""
    B, slots = attention_mask.shape
    index, held = aligned(cache_index, slots)
    offsets = torch.arange(T, device=cache_index.device)
    chunk = cache_index[:, None] + offsets if per_row(cache_index) else (cache_index + offsets)[None]
    valid = attention_mask != 0
    old = valid.gather(1, index.expand(B, slots)) & (held >= 0)
    new = valid.gather(1, chunk.expand(B, T))
    return torch.cat([old, new], dim=1).to(torch.long)


def finished_mask(padding, T, dtype):
    """The additive mask (B, 1, T, S + T) transformers' eager mask function makes of `padding`
    (`padding_mask`'s, over the columns of the module docstring): query t sees the valid columns up
    to its own, S + t; 0 where seen, the dtype's smallest value elsewhere."""
    B, columns = padding.shape
    c = torch.arange(columns, device=padding.device)
    t = torch.arange(T, device=padding.device)
    seen = (padding != 0)[:, None, :] & (c[None, :] <= columns - T + t[:, None])[None]
    return torch.zeros((B, 1, T, columns), dtype=dtype, device=padding.device).masked_fill(
        ~seen[:, None], torch.finfo(dtype).min)


def timeline_cache(layers, slots):
    """A transformers `Cache` of `layers` layers, each reporting `slots` past tokens (the mask sizes
    of the module docstring's columns), whose `update` goes to the layer being called (`handing`)."""
    from transformers.cache_utils import Cache

    return Cache(layers=[_layer_class()(slots) for _ in range(layers)])


@functools.cache
def _layer_class():
    """transformers' cache layer mixin, subclassed once (transformers is imported lazily)."""
    from transformers.cache_utils import CacheLayerMixin

    class TimelineLayer(CacheLayerMixin):
        is_sliding = False
        is_compileable = False

        def __init__(self, slots):
            super().__init__()
            self.slots, self.is_initialized = slots, True

        def lazy_initialization(self, key_states, value_states):  # pragma: no cover - initialised already
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            return _update(key_states, value_states)

        def get_mask_sizes(self, query_length):
            return self.slots + query_length, 0

        def update_indexer(self, key_states, *args, **kwargs):
            return _update_indexer(key_states)

        def get_seq_length(self):
            # the columns before the chunk; a layer's own call may see it shifted (`shifted`)
            return self.slots + (_shift.get() if _active.get() is not None else 0)

        def get_max_length(self):
            return self.slots

    return TimelineLayer


def _in_columns(cache, cache_index):
    """A slot (B, H, S, d) in the timeline's column order (module docstring)."""
    B, H, slots, d = cache.shape
    index, _ = aligned(cache_index, slots)
    if per_row(cache_index):
        return cache.gather(2, index[:, None, :, None].expand(B, H, slots, d))
    return cache.index_select(2, index)


def _update_indexer(key):
    """A sparse-attention indexer's keys in column order, then the chunk's (B, S + T, k); the chunk
    (B, T, k) is written into the active layer's indexer slot."""
    state = _active.get()
    if state is None or state.indexer is None:
        raise RuntimeError("a decoder layer wrote indexer keys to kvwire's timeline cache, which holds none for it "
                           "(the build's probe saw none)")
    state.indexer_calls += 1
    old = _in_columns(state.indexer[0], state.cache_index)[:, 0]
    state.indexer = write_chunk(state.indexer, key.float()[:, None], key.new_zeros(key.shape[:2] + (1,)).float()[:, None],
                                state.cache_index)
    return torch.cat([old.to(key.dtype), key], dim=1)


def _update(key, value):
    """The cache's keys/values in column order, then the chunk's (B, H, S + T, d); the chunk is
    written into the active layer's cache."""
    state = _active.get()
    if state is None:
        raise RuntimeError("a decoder layer wrote keys and values to kvwire's timeline cache outside its cached "
                           "call; the generic path gives this cache to its layers only while they run")
    state.calls += 1
    if state.calls > 1:
        raise RuntimeError("a decoder layer wrote keys and values to the cache twice in one call; the generic path "
                           "keeps one pair per layer that attends through the Cache API")
    k_cache, v_cache = state.cache
    keys, values = _in_columns(k_cache, state.cache_index), _in_columns(v_cache, state.cache_index)
    keys = torch.cat([keys.to(key.dtype), key], dim=2)
    values = torch.cat([values.to(value.dtype), value], dim=2)
    state.cache = write_chunk(state.cache, key.float(), value.float(), state.cache_index)
    return keys, values
