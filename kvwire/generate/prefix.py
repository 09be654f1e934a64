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
Stored keys/values live in pages of buffers allocated once (vLLM's block idea, for the store
only): a long-running server then holds constant memory instead of a heap fragmenting under
entries of every length.
"""
import heapq
import warnings
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
    """A stored sequence: its tokens, the runtime inputs it ran with, and per layer where the
    keys/values of its last n positions (n = all of them for a full layer) live in the store's
    pages: (first position, pool, page ids), position `first + j` at row j of those pages."""

    tokens: tuple
    inputs: tuple
    layers: list  # [(first position, _Pool, page ids: int64 tensor)]
    alive: bool = True  # False once evicted: its pages may hold another entry's keys/values

    @property
    def nbytes(self):
        """Bytes of the pages it holds (its last page may be partly used)."""
        return sum(len(pages) * pool.page_bytes for _, pool, pages in self.layers)

    def usable(self, c, slots):
        """Whether its first c positions can fill a cache with these layer `slots` (a ring of S
        slots needs positions [c - S, c), which a stored ring may have dropped)."""
        return c <= len(self.tokens) and all(first <= max(0, c - S) for (first, _, _), S in zip(self.layers, slots))


class _Pool:
    """Pages of `page_tokens` positions for the layers of one layout (kv_heads, head_dim, dtype,
    device): keys and values as (capacity * page_tokens, kv_heads, head_dim) rows, one buffer each,
    allocated once, with as many pages as the whole `budget` (bytes) holds. Pages are handed out lowest id first, so the CPU
    memory backed (touched lazily) is the most this pool ever held at once: at most the budget for
    a model whose layers share one layout (every family kvwire has); each further layout (an
    edited-in cache of another shape) has a pool of its own."""

    def __init__(self, like, budget, page_tokens, values_like=None):
        values_like = like if values_like is None else values_like  # values may have their own head size
        _, kv_heads, _, head_dim = like.shape
        value_dim = values_like.shape[3]
        self.page_tokens = page_tokens
        self.page_bytes = page_tokens * kv_heads * (head_dim + value_dim) * like.element_size()
        capacity = budget // self.page_bytes
        self.keys = torch.empty(capacity * page_tokens, kv_heads, head_dim, dtype=like.dtype, device=like.device)
        self.values = torch.empty(capacity * page_tokens, kv_heads, value_dim, dtype=like.dtype, device=like.device)
        self.free = list(range(capacity))  # a heap: the lowest free id first
        heapq.heapify(self.free)

    def take(self, n):
        if n > len(self.free):  # the budget bounds the pages in use: reaching here is a bug
            raise RuntimeError(f"prefix store pool: {n} pages asked for, {len(self.free)} free")
        return torch.tensor([heapq.heappop(self.free) for _ in range(n)], dtype=torch.long, device="cpu")  # bookkeeping

    def give(self, pages):
        for p in pages.tolist():
            heapq.heappush(self.free, p)

    def rows(self, pages, start, stop):
        """Buffer rows of positions [start, stop) counted from the first position of `pages`."""
        j = torch.arange(start, stop, device="cpu")  # page ids live on the CPU; the rows go to the pool's device
        return (pages[j // self.page_tokens] * self.page_tokens + j % self.page_tokens).to(self.keys.device)


class PrefixStore:
    """Recent sequences' keys/values, reused when a new prompt starts with one of them.

    Args:
        max_bytes: memory budget; storing past it evicts the least recently used entries first
            (an entry larger than the budget is not stored).
        min_tokens: shorter common prefixes are not worth a lookup's copy and are ignored.
        page_tokens: positions a page holds. Entries live in fixed-size pages of buffers allocated
            once (per layer layout, on the first store), not in tensors of their own: a server that
            stores and evicts sequences of every length all day then holds a constant amount of
            memory, where separate tensors would leave the heap ever more fragmented. On CPU the
            buffers' memory is backed only once used; on an accelerator the budget is allocated up front.

    Entries are keyed by tokens and by the runtime inputs (steering strengths) they ran with:
    keys/values of a steered prompt are not those of an unsteered one. Reuse gives the same
    tokens and log-probabilities as a full prefill, up to float rounding (the stored positions may
    have been computed in decode steps rather than in one prefill chunk).

    Example:
        >>> store = PrefixStore(max_bytes=256 << 20)
        >>> engine = kw.Engine(lm, prefix_store=store)   # its finished rows are kept; a prompt extending one reuses it
    """

    def __init__(self, max_bytes=512 << 20, min_tokens=16, page_tokens=16):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if not isinstance(page_tokens, int) or page_tokens < 1:
            raise ValueError(f"page_tokens must be an int >= 1, got {page_tokens!r}")
        self.max_bytes, self.min_tokens, self.page_tokens = max_bytes, min_tokens, page_tokens
        self.entries = OrderedDict()  # (tokens, inputs) -> Prefix, least recently used first
        self.pools = {}  # (kv_heads, key head_dim, value head_dim, dtype, device, page positions) -> _Pool
        self._warned = False
        self.nbytes = 0
        self.hits = self.lookups = 0
        self.disabled = None  # why the store stopped serving (`disable`), or None

    def __len__(self):
        return len(self.entries)

    def clear(self):
        """Forget every entry and free the pages' buffers (the next store allocates them again)."""
        self.entries.clear()
        self.pools.clear()
        self.nbytes = 0

    def disable(self, reason):
        """Forget every entry and neither store nor find any from now on, for every engine sharing
        the store: what a store that failed unexpectedly holds is not trusted."""
        self.clear()
        self.disabled = str(reason)

    def store(self, cache, row, pad, tokens, inputs):
        """Keep the keys/values of `tokens` (the positions written in `row` of `cache`, the first
        real one at timeline index `pad`) under runtime inputs `inputs` (a hashable key)."""
        tokens, n = tuple(tokens), len(tokens)
        if self.disabled is not None or n < self.min_tokens or (tokens, inputs) in self.entries:
            return
        for key in [k for k in self.entries if k[1] == inputs and tokens[:len(k[0])] == k[0]]:
            self._drop(key)  # a conversation's earlier turns: covered now
        try:
            pools = [self._pool(k, v) for k, v in cache]
        except (RuntimeError, MemoryError) as e:  # no memory for the buffers: serve on, without reuse
            if not self._warned:
                warnings.warn(f"the prefix store could not allocate its {self.max_bytes} bytes ({e}); "
                              f"sequences are not stored", RuntimeWarning, stacklevel=2)
                self._warned = True
            return
        firsts = [max(0, n - k.shape[2]) for k, _ in cache]
        counts = [-(-(n - first) // pool.page_tokens) for first, pool in zip(firsts, pools)]
        need = sum(c * pool.page_bytes for c, pool in zip(counts, pools))
        if need > self.max_bytes:
            return
        while self.nbytes + need > self.max_bytes:
            self._drop(next(iter(self.entries)))
        layers = []
        try:
            for (k, v), pool, first, count in zip(cache, pools, firsts, counts):
                S, pages = k.shape[2], pool.take(count)
                layers.append((first, pool, pages))
                slots = (torch.arange(first, n, device=k.device) + pad) % S
                rows = pool.rows(pages, 0, n - first)
                pool.keys.index_copy_(0, rows, k[row].index_select(1, slots).transpose(0, 1).to(pool.keys.device))
                pool.values.index_copy_(0, rows, v[row].index_select(1, slots).transpose(0, 1).to(pool.values.device))
        except BaseException as e:  # a failed copy stores nothing and keeps every page
            for _, pool, pages in layers:
                pool.give(pages)
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)):
                raise
            warnings.warn("the prefix store ran out of memory copying a sequence; it was not stored",
                          RuntimeWarning, stacklevel=2)
            return
        self.entries[(tokens, inputs)] = Prefix(tokens, inputs, layers)
        self.nbytes += need

    def _pool(self, k, v):
        """The pool of layers shaped like cache keys `k` (batch, kv_heads, slots, head_dim) and values
        `v` (..., value head_dim), made on first use. A layer of fewer slots than `page_tokens` (a
        state slot holds one) never stores more positions than it has slots: its pool's pages hold
        that many, so a one-slot state does not take a 16-position page."""
        page = min(self.page_tokens, k.shape[2])
        key = (k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device, page)
        if key not in self.pools:
            self.pools[key] = _Pool(k, self.max_bytes, page, v)
        return self.pools[key]

    def _drop(self, key):
        entry = self.entries.pop(key)
        entry.alive = False
        for _, pool, pages in entry.layers:
            pool.give(pages)
        self.nbytes -= entry.nbytes

    def lookup(self, tokens, inputs, slots):
        """The longest usable stored prefix of `tokens` (leaving at least the last token to run)
        under the same inputs: (Prefix, c) with c positions to reuse, or (None, 0). Restore it
        before the next `store`, which may evict it and reuse its pages (the store is not
        thread-safe: one engine thread uses it)."""
        self.lookups += 1
        if self.disabled is not None:
            return None, 0
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
        if not entry.alive:
            raise RuntimeError("this prefix store entry was evicted (its pages hold other keys/values now); "
                               "restore a lookup's entry before the next store")
        for (first, pool, pages), (kd, vd) in zip(entry.layers, cache):
            S = kd.shape[2]
            lo = max(first, c - S)
            if lo >= c:
                continue
            slots = ((torch.arange(lo, c, device=kd.device) + pad) % S)
            rows = pool.rows(pages, lo - first, c - first)
            kd[row].index_copy_(1, slots, pool.keys.index_select(0, rows).transpose(0, 1).to(kd.device))
            vd[row].index_copy_(1, slots, pool.values.index_select(0, rows).transpose(0, 1).to(vd.device))


def _common(a, b, limit):
    """Length of the common prefix of sequences a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
