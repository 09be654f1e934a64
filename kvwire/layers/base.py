"""Markers and the cache/position protocol that graph passes rely on.

A `Layer` is what `kw.trace`/`kw.clone` treat as one call in the layer graph. A `Block` is a layer
made of layers (a decoder block): at the default "block" depth it is one call, at "layer" depth the
graph goes inside it.

Protocol, used by `kw.with_cache`:

- A layer that needs positions defines `uses_positions = True` and
  `forward_cached(x, *, positions)`; plainly called it uses `arange(T)`.
- A layer that needs past keys/values defines `cache_spec(batch_size, max_length, dtype)` returning
  the `(key_shape, value_shape)` it needs, and
  `forward_cached(x, *, positions, cache_index, attention_mask, cache) -> (out, next_cache)`.
"""
from torch import nn


class Layer(nn.Module):
    """A node of the layer graph: one call site seen by `clone`'s `fn`."""

    uses_positions = False

    def cache_spec(self, batch_size, max_length, dtype):
        """Shapes of the cache this layer needs, or None when it needs none."""
        return None


class Block(Layer):
    """A layer made of layers (a decoder block): one node at "block" depth, opened at "layer" depth."""
