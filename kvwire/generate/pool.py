"""Caches kept between generation calls, one set per batch size, for the engine and beam search."""


class CachePool:
    """Idle caches of a model's cached graph, by batch size, reused by the next call of that size.

    A call takes the caches for its batch size when they are long enough and not more than twice
    as long (decode attends over every slot of the timeline); taking removes them, so interleaved
    calls (two streams) never share caches. A finished call gives its caches back.

    Example:
        >>> pool = CachePool()
        >>> length, cache = pool.take(2, 64)         # (64, None): nothing kept yet
        >>> pool.give(2, 64, graph.init_cache(2, 64))
        >>> pool.take(2, 48)[0]                      # 64: reused
        64
    """

    def __init__(self):
        self._kept = {}  # batch size -> (max_length, cache)

    def take(self, batch_size, max_length):
        """(timeline length, cache or None): kept caches that fit `max_length`, else (max_length, None)."""
        kept = self._kept.pop(batch_size, None)
        if kept is not None and max_length <= kept[0] <= 2 * max_length:
            return kept
        return max_length, None

    def give(self, batch_size, max_length, cache):
        if cache is not None:
            self._kept[batch_size] = (max_length, cache)

    def clear(self):
        self._kept = {}

    def to(self, device):
        """Move the kept caches (after the model moved)."""
        self._kept = {B: (length, tuple(tuple(t.to(device) for t in pair) for pair in cache))
                      for B, (length, cache) in self._kept.items()}

    def batch_sizes(self):
        return sorted(self._kept)

    def tensors(self):
        """Every kept key/value tensor."""
        return [t for _, cache in self._kept.values() for pair in cache for t in pair]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors())
