"""Boolean attention masks of the cached graph, built from tensors only (no Python branches on
values), so one graph serves prefill and decode and exports as it is. Boolean algebra uses
torch.logical_* (Core ML's converter has no mapping for the `&` / `|` operator overloads).

Cache slot `s` of a layer with `S` slots holds absolute index `i` with `i % S == s` (a ring; for a
full-length cache `i == s`). Absolute index = the position in the cache's timeline, which is what
`cache_index` counts and what `attention_mask` (B, max_length) marks valid (left padding is invalid).

`cache_index` is () (one write index for the batch, as exported graphs take it) or (B,) (one per
row: the engine's rows join a running batch at different times). The rank is static, so choosing
between the two is a shape decision made at trace time, not control flow on values.
"""
import torch


def per_row(cache_index):
    """Whether cache_index holds one write index per row ((B,)) rather than one for the batch (())."""
    return cache_index.dim() == 1


def ring_indices(cache_index, T, n, slots):
    """Slots that the last n tokens of a T-token chunk starting at cache_index are written to:
    (n,), or (B, n) for a per-row cache_index."""
    offsets = torch.arange(n, device=cache_index.device) + (T - n)
    if per_row(cache_index):
        return (cache_index[:, None] + offsets) % slots
    return (cache_index + offsets) % slots


def ring_sources(cache_index, T, slots):
    """For every cache slot, the chunk token that lands in it last: (source (slots,), index (slots,)).

    source[s] is that token's index in the chunk, or negative when no token of the chunk lands in
    slot s (the slot keeps its value); index is source clamped to >= 0 for gathering. Shapes do not
    depend on T, which keeps exported graphs free of shape guards.
    """
    s = torch.arange(slots, device=cache_index.device)
    index = cache_index[:, None] if per_row(cache_index) else cache_index  # (B, slots) per row
    source = T - 1 - torch.remainder(index + T - 1 - s + slots, slots)  # operands kept >= 0
    return source, _nonnegative(source)


def slot_mask(cache_index, T, slots, window, attention_mask):
    """Which cache slots (as they were before this chunk) each chunk query may see: (B, T, slots)."""
    if per_row(cache_index):
        return _slot_mask_per_row(cache_index, T, slots, window, attention_mask)
    device = cache_index.device
    s = torch.arange(slots, device=device)
    # absolute index held in slot s (remainder's operand kept >= 0: some runtimes truncate negatives)
    held = cache_index - 1 - torch.remainder(cache_index - 1 - s + slots, slots)
    queries = cache_index + torch.arange(T, device=device)
    ok = torch.logical_and((held >= 0)[None, :], torch.ones(T, 1, dtype=torch.bool, device=device))
    if window is not None:
        ok = torch.logical_and(ok, queries[:, None] - held[None, :] < window)
    valid = _gather(attention_mask, _nonnegative(held))  # (B, slots)
    return torch.logical_and(ok[None], valid[:, None, :])


def _slot_mask_per_row(cache_index, T, slots, window, attention_mask):
    """slot_mask for a (B,) cache_index: each row's slots hold the indices before its own index."""
    device = cache_index.device
    s = torch.arange(slots, device=device)
    index = cache_index[:, None]
    held = index - 1 - torch.remainder(index - 1 - s + slots, slots)  # (B, slots)
    ok = (held >= 0)[:, None, :].expand(-1, T, -1)
    if window is not None:
        queries = index + torch.arange(T, device=device)  # (B, T)
        ok = torch.logical_and(ok, queries[:, :, None] - held[:, None, :] < window)
    valid = _gather_rows(attention_mask, _nonnegative(held))  # (B, slots)
    return torch.logical_and(ok, valid[:, None, :])


def chunk_mask(cache_index, T, window, attention_mask):
    """Which chunk tokens each chunk query may see: causal, windowed, valid: (B|1, T, T).

    A query always sees itself, so a padding row stays finite instead of softmaxing nothing.
    """
    device = cache_index.device
    i = torch.arange(T, device=device)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok = torch.logical_and(ok, i[:, None] - i[None, :] < window)
    ok = ok[None]
    if attention_mask is not None:
        if per_row(cache_index):
            valid = _gather_rows(attention_mask, cache_index[:, None] + i)  # (B, T)
        else:
            valid = _gather(attention_mask, cache_index + i)  # (B, T)
        ok = torch.logical_and(ok, valid[:, None, :])
    return torch.logical_or(ok, torch.eye(T, dtype=torch.bool, device=device)[None])


def _gather(attention_mask, index):
    """attention_mask[:, index] as bool. The mask may be bool or int32 (Core ML exports take an
    int32 mask: its converter gathers no bool tensors); the dtype is static, not a value."""
    valid = attention_mask.index_select(1, index)
    return valid if valid.dtype == torch.bool else valid != 0


def _gather_rows(attention_mask, index):
    """attention_mask[b, index[b]] as bool, index (B, n): each row its own indices."""
    valid = attention_mask.gather(1, index)
    return valid if valid.dtype == torch.bool else valid != 0


def _nonnegative(index):
    """max(index, 0) for int tensors, kept integer (Core ML's converter turns clamp into float clip)."""
    return torch.where(index < 0, torch.zeros_like(index), index)
