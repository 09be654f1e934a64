"""Markers and the cache/position protocol that graph passes rely on.

A `Layer` is what `kw.trace`/`kw.clone` treat as one call in the layer graph. A `Block` is a layer
made of layers (a decoder block): at the default "block" depth it is one call, at "layer" depth the
graph goes inside it.

Protocol, used by `kw.with_cache`:

- A layer that needs positions defines `uses_positions = True` and
  `forward_cached(x, *, positions)`; plainly called it uses `arange(T)`.
- A layer that needs to know where each row stands in the cache without keeping one (the generic
  path's prelude, building masks over the cache's columns) also sets `uses_timeline = True`: its
  `forward_cached` then gets `cache_index` and `attention_mask` as keywords too.
- A layer that needs past keys/values defines `cache_spec(batch_size, max_length, dtype)` returning
  the `(key_shape, value_shape)` it needs, and
  `forward_cached(x, *, positions, cache_index, attention_mask, cache) -> (out, next_cache)`.
- A layer that keeps several caches (a hybrid decoder layer: attention keys/values and a
  recurrent state) lists them in `cache_parts`, {name: module whose `cache_spec` gives that
  cache}: each is a slot of its own (named `<layer>.<name>`), `forward_cached` gets `cache` as a
  tuple of one pair per part, in that order, and returns its next cache as such a tuple.
- A layer that reads per-row values chosen at call time (a steering strength, say) names them in
  `runtime_inputs` ({name: dtype}; each value is a (B,) tensor), accepts them as keywords of
  `forward_cached(x, *, positions, **inputs)`, and says what they are when the caller gives none
  in `runtime_defaults(batch_size, prompt_lengths)` (prompt_lengths: (B,) or None). The cached
  graph turns each name into one graph input, shared by every layer that reads it; exported
  models keep them as inputs. Plainly called, such a layer uses its own defaults.
"""
from torch import nn


class Layer(nn.Module):
    """A node of the layer graph: one call site seen by `clone`'s `fn`."""

    uses_positions = False
    runtime_inputs = {}

    def cache_spec(self, batch_size, max_length, dtype):
        """Shapes of the cache this layer needs, or None when it needs none."""
        return None

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        """Values of `runtime_inputs` when a caller gives none: {name: (batch_size,) tensor}."""
        return {}


class Block(Layer):
    """A layer made of layers (a decoder block): one node at "block" depth, opened at "layer" depth.
    An `opaque` block (one made of another library's modules) stays one node at every depth."""

    opaque = False
