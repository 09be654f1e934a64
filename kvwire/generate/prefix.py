"""Keys and values of a row's timeline: copying them between caches, and the prefix store.

A cache row holds, per layer, the keys/values of timeline positions `a` in slot `a % S` (S = the
layer's slots: max_length for a full layer, a ring of window - 1 for a sliding one), for the last
S positions written. Copying a span of positions between caches of different lengths maps each
position to its slot on both sides, so a prompt prefilled into a short scratch cache lands in
the engine's long one exactly, rings included.

The prefix store keeps recent sequences' keys/values so that a prompt starting with one of them
(a conversation's next turn, a shared system prompt) is not prefilled again. Attention is causal,
so the keys/values of positions < c depend only on the first c tokens: any common prefix of a
stored sequence can be reused from a full layer. A ring keeps only its last S positions, so from
a model with sliding layers a stored sequence is reused only where those positions suffice.
"""
from collections import OrderedDict
from dataclasses import dataclass

import torch


def copy_positions(src, src_row, src_pad, dst, dst_row, dst_pad, start, stop):
    """Copy the keys/values of positions [start, stop) of a row (positions counted from the row's
    first real token; `*_pad` is where that token sits in each cache's timeline) from cache `src`
    into cache `dst`. Each layer copies the last positions both of its caches can hold."""
    for (ks, vs), (kd, vd) in zip(src, dst):
        S_s, S_d = ks.shape[2], kd.shape[2]
        lo = max(start, stop - min(S_s, S_d))
        if lo >= stop:
            continue
        pos = torch.arange(lo, stop, device=ks.device)
        take, put = (pos + src_pad) % S_s, ((pos + dst_pad) % S_d).to(kd.device)
        kd[dst_row].index_copy_(1, put, ks[src_row].index_select(1, take).to(kd.device))
        vd[dst_row].index_copy_(1, put, vs[src_row].index_select(1, take).to(vd.device))


@dataclass
class Prefix:
    """A stored sequence: its tokens, the runtime inputs it ran with, and per layer the keys and
    values (kv_heads, n, head_dim) of its last n positions (n = all of them for a full layer)."""

    tokens: tuple
    inputs: tuple
    layers: list  # [(first position, keys, values)]

    @property
    def nbytes(self):
        return sum(k.numel() * k.element_size() * 2 for _, k, _ in self.layers)

    def usable(self, c, slots):
        """Whether its first c positions can fill a cache with these layer `slots` (a ring of S
        slots needs positions [c - S, c), which a stored ring may have dropped)."""
        return c <= len(self.tokens) and all(first <= max(0, c - S) for (first, _, _), S in zip(self.layers, slots))


class PrefixStore:
    """Recent sequences' keys/values, reused when a new prompt starts with one of them.

    Args:
        max_bytes: memory budget; storing past it evicts the least recently used entries first
            (an entry larger than the budget is not stored).
        min_tokens: shorter common prefixes are not worth a lookup's copy and are ignored.

    Entries are keyed by tokens and by the runtime inputs (steering strengths) they ran with:
    keys/values of a steered prompt are not those of an unsteered one. Reuse gives the same
    tokens and log-probabilities as a full prefill, up to float rounding (the stored positions may
    have been computed in decode steps rather than in one prefill chunk).

    Example:
        >>> store = PrefixStore(max_bytes=256 << 20)
        >>> engine = kw.Engine(lm, prefix_store=store)   # its finished rows are kept; a prompt extending one reuses it
    """

    def __init__(self, max_bytes=512 << 20, min_tokens=16):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries = OrderedDict()  # (tokens, inputs) -> Prefix, least recently used first
        self.nbytes = 0
        self.hits = self.lookups = 0

    def __len__(self):
        return len(self.entries)

    def clear(self):
        self.entries.clear()
        self.nbytes = 0

    def store(self, cache, row, pad, tokens, inputs):
        """Keep the keys/values of `tokens` (the positions written in `row` of `cache`, the first
        real one at timeline index `pad`) under runtime inputs `inputs` (a hashable key)."""
        tokens, n = tuple(tokens), len(tokens)
        if n < self.min_tokens or (tokens, inputs) in self.entries:
            return
        layers = []
        for k, v in cache:
            S = k.shape[2]
            first = max(0, n - S)
            slots = (torch.arange(first, n, device=k.device) + pad) % S
            layers.append((first, k[row].index_select(1, slots), v[row].index_select(1, slots)))
        entry = Prefix(tokens, inputs, layers)
        for key in [k for k in self.entries if k[1] == inputs and tokens[:len(k[0])] == k[0]]:
            self.nbytes -= self.entries.pop(key).nbytes  # a conversation's earlier turns: covered now
        if entry.nbytes > self.max_bytes:
            return
        self.entries[(tokens, inputs)] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def lookup(self, tokens, inputs, slots):
        """The longest usable stored prefix of `tokens` (leaving at least the last token to run)
        under the same inputs: (Prefix, c) with c positions to reuse, or (None, 0)."""
        self.lookups += 1
        best, best_c = None, 0
        for (stored, key), entry in self.entries.items():
            if key != inputs:
                continue
            c = _common(stored, tokens, len(tokens) - 1)
            if c > best_c and c >= self.min_tokens and entry.usable(c, slots):
                best, best_c = entry, c
        if best is not None:
            self.entries.move_to_end((best.tokens, best.inputs))
            self.hits += 1
        return best, best_c

    def restore(self, entry, c, cache, row, pad):
        """Write the entry's first c positions into `row` of `cache` (first real token at `pad`)."""
        for (first, k, v), (kd, vd) in zip(entry.layers, cache):
            S = kd.shape[2]
            lo = max(first, c - S)
            if lo >= c:
                continue
            slots = ((torch.arange(lo, c, device=k.device) + pad) % S).to(kd.device)
            kd[row].index_copy_(1, slots, k[:, lo - first:c - first].to(kd.device))
            vd[row].index_copy_(1, slots, v[:, lo - first:c - first].to(vd.device))


def _common(a, b, limit):
    """Length of the common prefix of sequences a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
