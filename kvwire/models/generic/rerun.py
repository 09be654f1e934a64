"""The generic path's last resort: decoder layers whose cache kvwire cannot find, cached by their inputs.

A model whose layers keep their past somewhere the cache pass cannot see (module attributes, a
cache class of their own, state passed between layers, no cache at all) or compute with more than
their keys and values (one past length for the whole batch, compressed keys) is still a causal
model: each layer's output at a token depends only on its inputs at that token and before. So each
decoder layer keeps the hidden states it was given, one column per token like a key cache
((B, 1, max_length, D)), and the prelude keeps the token ids ((B, 1, max_length, 1)). A cached call
writes the chunk into those columns, then runs the model's own forward over every row's history
packed to the left (`packing`):

    row b:   [its real tokens in order, chunk included] + [pads to max_length]

so a token's column is its position and every layer runs exactly as in the model's uncached
forward of that row alone (pads come after every real token, where a causal layer never looks);
the chunk's outputs are gathered back. Edits at `layers.N` and at the sites inside a block apply
to the whole history again, as the uncached forward of the edited model does.

It is exact and keeps the contract (static shapes, per-row positions, no data-dependent control
flow) but it is not a key/value cache: every call runs each layer over the window, so a decode
step costs a prefill of it. Compiled or exported, the window is max_length; run eagerly, it ends at
the longest row's last token (one read of that count a call). The build uses it only where the
cache pass does not fit, and says so (`GenericBackbone.rerun_reason`).
"""
import math

import torch

from ...kernels.tracing import is_exporting
from ...layers.attention import write_chunk
from ...layers.masks import per_row

IDS_LIMIT = 1 << 24  # token ids live in the float32 cache: exact below 2**24


def packing(cache_index, T, attention_mask):
    """(source, chunk, real) of one cached call over a window of W columns: source (B, W) int64
    the cache column each packed column reads (a row's real columns up to the chunk's end, in
    order, then the rest); chunk (B, T) the packed column of each chunk token; real (B, W) bool,
    the packed columns holding a real token. W is max_length in a compiled or exported graph, and
    run eagerly the longest row's count of real tokens (the rest is pads no real token reads)."""
    B, M = attention_mask.shape
    device = attention_mask.device
    columns = torch.arange(M, device=device)
    start = cache_index[:, None] if per_row(cache_index) else cache_index.reshape(1, 1)
    valid = attention_mask & (columns[None] < start + T)
    count = valid.sum(dim=1, keepdim=True)
    # each column's packed place: real ones first in order, then the others in order (a permutation)
    place = torch.where(valid, valid.cumsum(dim=1) - 1, count + (~valid).cumsum(dim=1) - 1)
    source = torch.zeros_like(place).scatter(1, place, columns[None].expand(B, M))
    chunk = place.gather(1, (start + torch.arange(T, device=device)[None]).expand(B, T))
    real = columns[None] < count
    if not (torch.compiler.is_compiling() or is_exporting()):
        # run eagerly, the window ends at the longest row's last real token, not at max_length (a
        # compiled or exported graph keeps the static max_length); a pad of the chunk reads any column
        width = max(int(count.max()), 1)
        source, real, chunk = source[:, :width], real[:, :width], chunk.clamp(max=width - 1)
    return source, chunk, real


def positions(real):
    """(B, M) int64: each packed column's position, its index; the pads after a row's real columns
    repeat its last position (a position table or a scaled rotary never sees more than the row
    holds)."""
    M = real.shape[1]
    last = real.sum(dim=1, keepdim=True).clamp(min=1) - 1
    return torch.minimum(torch.arange(M, device=real.device)[None], last)


def write(cache, columns, cache_index, gate=None):
    """The (kept, spare) cache pair with `columns` (B, T, ...) written at cache_index as a
    (B, 1, T, C) chunk, C the product of its trailing sizes, and the chunk's `gate` (B, T, 1) (a
    gated edit's, where one is given; else zeros) in the spare half (B, 1, max_length, 1)."""
    kept = columns.float().flatten(2)[:, None]
    spare = kept.new_zeros(kept.shape[:-1] + (1,)) if gate is None else gate.float().reshape(kept.shape[:-1] + (1,))
    return write_chunk(cache, kept, spare, cache_index)


def gates(cache, source):
    """(B, M, 1): the gates `write` kept in the spare half of a cache pair, in packed column order."""
    spare = cache[1][:, 0]
    return spare.gather(1, source[..., None])


def window(cache, source, shape=None):
    """(B, M, *shape): the kept half of a cache pair (B, 1, M, C) in packed column order, each
    column's C numbers in `shape` (default (C,))."""
    kept = cache[0][:, 0]
    packed = kept.gather(1, source[..., None].expand(source.shape + kept.shape[-1:]))
    return packed if shape is None else packed.reshape(packed.shape[:2] + tuple(shape))


def chunk_of(values, chunk):
    """(B, T, ...): the chunk's columns of packed `values` (B, M, ...)."""
    index = chunk.reshape(chunk.shape + (1,) * (values.dim() - 2))
    return values.gather(1, index.expand(chunk.shape + values.shape[2:]))


def spec(batch_size, max_length, shape):
    """(kept shape, spare shape) of a slot keeping a tensor of `shape` per token (hidden states
    (D,), or (streams, D) for a model with several residual streams)."""
    return (batch_size, 1, max_length, math.prod(shape)), (batch_size, 1, max_length, 1)
