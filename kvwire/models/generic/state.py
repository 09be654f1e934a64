"""Where kvwire's state slots meet transformers' recurrent layers: a transformers `Cache` whose
linear-attention layers are views of one decoder layer's kvwire state slot.

transformers' recurrent and state-space mixers (short convolutions, Mamba/SSM scans, gated
delta-nets) keep their state in the Cache API: `get_conv_state` / `update_conv_state` and
`get_recurrent_state` / `update_recurrent_state` of a `LinearAttentionLayer` per layer index. A
generic decoder layer with such a mixer gets a state slot in kvwire's cache contract: a pair
(conv (B, 1, 1, Nc), recurrent (B, 1, 1, Nr)), every state the layer keeps flattened into one of
the two — a ring of one slot (what `kvwire.steer.gate.PromptProbe` holds), so the engine's copies,
growth and prefix store treat it as they treat a ring: reused only at the length it was stored at.

A cached call hands the layer a `StateCache` holding views of that pair and always reporting a
previous state, so transformers' own code continues the state (its T == 1 step, or its chunked
form from an initial state) and prefill chunks carry it. A mixer whose chunked form ignores the
initial state (Mamba-1's scan) continues it one token at a time (`kvwire.models.generic.stepping`). Before the call a row whose chunk holds
its first real token (position 0, not a pad) starts from zeros: equal to transformers starting
without a state (a zero conv history is the conv's zero padding; a zero initial state, none). The
call passes the chunk's padding mask as the layer's 2D `attention_mask`, which transformers' mixers
apply to their inputs, so left pads do not enter the state.

A layer keeping both (Falcon-H1's attention beside its Mamba mixer, Zamba's hybrid layers) has a
state slot and a key/value slot. Its `attention_mask` belongs to its attention (whose cache and
mask kvwire's seam provides), so the padding mask goes to its mixer's own `attention_mask`
(`padding`, through a hook on the mixer), and the cache it is handed passes the chunk's keys and
values back unchanged from `update`.

Which states a layer keeps, their shapes and dtypes are found by running it once on the build's
probe with transformers' own lazily initialised cache layers: nothing here is keyed by family.
"""
import copy
import dataclasses
import functools
import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...layers.attention import functional_cache_writes
from ...layers.masks import per_row
from . import stepping
from .scoped import Scoped

_padding = Scoped(None)
# a dtype other than the probe's float32, to see which states follow the model's: bfloat16 first,
# the dtype a cast model runs in (in float64 a scan's float32 accumulator can be promoted, so it
# would look as if it followed), float64 where a layer has an op without bfloat16
PROBE_DTYPES = (torch.bfloat16, torch.float64)
HOOKED = "_kvwire_padding_hook"  # attribute marking a mixer that has its hook (installed once)


class Sized:
    """A state's number of elements: the product of its `shape` (without the batch dimension)."""

    @property
    def size(self):
        return math.prod(self.shape)


@dataclass(frozen=True)
class State(Sized):
    """One tensor a layer keeps: cache layer `layer`, state `index`, `kind` "conv" or "recurrent",
    its shape without the batch dimension and its dtype (the model weights' where it `follows`
    them: a model cast after the build hands it in its own dtype)."""

    layer: int
    index: int
    kind: str
    shape: tuple
    dtype: torch.dtype
    follows: bool = False

    @property
    def key(self):
        """What names it among the states a call leaves (`with_followers`)."""
        return self.layer, self.index, self.kind


def probe_cache(layers):
    """A transformers cache of `layers` lazily initialised cache layers that take keys/values,
    linear-attention states and a sparse-attention indexer's keys (the build's probe reads which of
    them a decoder layer fills)."""
    from transformers.cache_utils import Cache

    return Cache(layers=[_probe_layer_class()() for _ in range(layers)])


@functools.cache
def _probe_layer_class():
    """transformers' layer for keys/values and linear-attention states, taking indexer keys too."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    class ProbeLayer(LinearAttentionAndFullAttentionLayer):
        indexer_keys = None

        def update_indexer(self, key_states, *args, **kwargs):
            held = self.indexer_keys
            self.indexer_keys = key_states if held is None else torch.cat([held, key_states], dim=1)
            return self.indexer_keys

    return ProbeLayer


def wrote_keys(cache):
    """Whether a call wrote keys/values into `probe_cache`'s cache (attention computed outside
    transformers' attention interface)."""
    return any(getattr(layer, "is_initialized", False) for layer in cache.layers)


def found_states(cache):
    """[State] that a call of one decoder layer filled in `probe_cache`'s cache, in a fixed order."""
    states = []
    for i, layer in enumerate(cache.layers):
        for kind, tensors, ready in (("conv", layer.conv_states, layer.is_conv_states_initialized),
                                     ("recurrent", layer.recurrent_states, layer.is_recurrent_states_initialized)):
            for s in sorted(tensors):
                if ready[s]:
                    t = tensors[s]
                    states.append(State(i, s, kind, tuple(t.shape[1:]), t.dtype))
    return states


def with_followers(block, states, left):
    """`states` (`State`s, or `kvwire.models.generic.held.Held`s) with `follows` set where the state
    takes the model's dtype: `left(twin, dtype)` runs the layer's probe call on `twin`, a copy of
    `block` in another dtype (`PROBE_DTYPES`), and gives {key: dtype} of the states it left. A state
    left in that dtype follows the model; one left in float32 is kept so whatever its dtype.
    Unchanged where no such call runs."""
    for dtype in PROBE_DTYPES:
        try:
            twin = copy.deepcopy(block).to(dtype)
            dtypes = left(twin, dtype)
        except Exception:  # noqa: BLE001 - a layer that does not run in this dtype: the next, or as found
            continue
        return [dataclasses.replace(s, follows=dtypes.get(s.key) == dtype) for s in states]
    return states


def spec(states, batch_size):
    """The state slot's pair of shapes: (B, 1, 1, conv sizes) and (B, 1, 1, recurrent sizes), each
    at least one wide (a layer without recurrent states keeps an unused column)."""
    return tuple((batch_size, 1, 1, max(1, sum(s.size for s in states if s.kind == kind)))
                 for kind in ("conv", "recurrent"))


def fresh_rows(positions, cache_index, attention_mask):
    """(real (B, T) float32: not a pad, fresh (B,) float32: the row's first real token is in this chunk)."""
    B, T = positions.shape
    offsets = torch.arange(T, device=positions.device)
    index = cache_index[:, None] + offsets if per_row(cache_index) else (cache_index + offsets)[None]
    real = attention_mask.gather(1, index.expand(B, T)).to(torch.float32)
    fresh = (real * (positions == 0).to(torch.float32)).amax(dim=1)
    return real, fresh


class StateCache:
    """Builds, per cached call, the transformers cache a decoder layer reads its states from (see the
    module docstring), and collects the states it leaves."""

    use_cache = False  # the layer's cached calls pass no use_cache (its Cache-API mixers write without it)

    def __init__(self, states, layers):
        self.states, self.layers = list(states), layers
        # the layer's mixer continues a state with several tokens only one at a time (set by the
        # build's chunked check; `kvwire.models.generic.stepping`)
        self.steps = False

    def open(self, slot, keep, steps=False, dtype=None):
        """A transformers `Cache` over `slot` (the pair), rows scaled by `keep` (B,) (0: start afresh),
        the states that follow the model in `dtype` (its weights'); with `steps`, marked for the
        layer's mixer to go token by token."""
        from transformers.cache_utils import Cache, DummyLayer

        views = {}
        for s, part in state_views(slot, self.states, dtype, keep):
            views.setdefault(s.layer, []).append((s, part))
        layers = [_view_layer(views[i]) if i in views else _passing(DummyLayer()) for i in range(self.layers)]
        cache = Cache(layers=layers)
        if steps:
            setattr(cache, stepping.MARK, True)
        return cache

    def close(self, cache, slot):
        """The slot after the call: the states the layer left in `cache`, flattened back (written into
        `slot` in place in eager calls)."""
        B = slot[0].shape[0]
        parts = {"conv": [], "recurrent": []}
        for s in self.states:
            layer = cache.layers[s.layer]
            t = (layer.conv_states if s.kind == "conv" else layer.recurrent_states)[s.index]
            parts[s.kind].append(t.reshape(B, -1).to(torch.float32))
        # an unused column (a layer with no recurrent state) is passed on as a copy: an exported
        # graph's output is then its own tensor, not its input's
        new = tuple(torch.cat(parts[kind], dim=1).view(t.shape) if parts[kind] else t.clone()
                    for kind, t in zip(("conv", "recurrent"), slot))
        if functional_cache_writes():
            return new
        for old, value in zip(slot, new):
            old.copy_(value)  # in place, as cached attention writes its keys and values
        return slot


def state_views(slot, states, dtype=None, keep=None):
    """[(state, view (B, *shape))] of each of `states` (laid out in `slot`'s pair by kind, in that
    order, as `spec` sizes it), rows scaled by `keep` (B,) where given (0: start afresh), in its
    dtype: `dtype` (the layer weights') for a state that follows the model, else its own."""
    B = slot[0].shape[0]
    flat = {kind: (t if keep is None else t * keep[:, None, None, None]).view(B, -1)
            for kind, t in zip(("conv", "recurrent"), slot)}
    at = {"conv": 0, "recurrent": 0}
    views = []
    for s in states:
        part = flat[s.kind][:, at[s.kind]:at[s.kind] + s.size].reshape(B, *s.shape)
        views.append((s, part.to(dtype if s.follows and dtype is not None else s.dtype)))
        at[s.kind] += s.size
    return views


def recurrent_left(slot, parts):
    """The state slot `slot` (the pair) after a call that left `parts` [(B, n_i)] float32, its
    recurrent half in that order (the conv half kept as a copy): a new pair in functional (traced)
    calls, else `slot` itself written in place, as cached attention writes its keys and values."""
    new = (slot[0].clone(), torch.cat(parts, dim=1).view(slot[1].shape))
    if functional_cache_writes():
        return new
    slot[1].copy_(new[1])
    return slot


def _view_layer(parts):
    """transformers' LinearAttentionLayer over given state tensors, initialised, with a previous state."""
    from transformers.cache_utils import LinearAttentionLayer

    indices = {s.index for s, _ in parts}
    layer = LinearAttentionLayer(number_of_states=max(indices) + 1)
    for s, t in parts:
        if s.kind == "conv":
            layer.conv_states[s.index] = t
            layer.conv_kernel_size[s.index] = t.shape[-1]
            layer.is_conv_states_initialized[s.index] = True
        else:
            layer.recurrent_states[s.index] = t
            layer.is_recurrent_states_initialized[s.index] = True
        layer.has_previous_state[s.index] = True
        layer.device, layer.dtype = t.device, t.dtype
    # its token count, a tensor made in __init__, would be a constant an exported step cannot hold:
    # one made from the states is the graph's own (kvwire's rows keep their positions elsewhere)
    layer.cumulative_length_linear = parts[0][1].new_zeros((), dtype=torch.long)
    return _passing(layer)


def _passing(layer):
    """`layer` with an `update` that hands keys and values back as given: a hybrid layer's attention
    writes its chunk there, and kvwire's seam keeps the cache."""
    layer.update = lambda key, value, *args, **kwargs: (key, value)
    return layer


def mixer_takes_mask(mixer):
    """Whether the mixer's forward takes an `attention_mask` (the padding mask `padding` gives it)."""
    return "attention_mask" in inspect.signature(mixer.forward).parameters


def install_padding(mixer):
    """Give a hybrid layer's mixer its hook (once): inside `padding`, its `attention_mask` is the
    chunk's padding mask."""
    if not getattr(mixer, HOOKED, False):
        mixer.register_forward_pre_hook(_mask_mixer, with_kwargs=True)
        setattr(mixer, HOOKED, True)


@contextmanager
def padding(mixer, real):
    """Inside: `mixer` (hooked by `install_padding`) takes `real` (B, T) as its `attention_mask`."""
    token = _padding.set((mixer, real))
    try:
        yield
    finally:
        _padding.reset(token)


def _mask_mixer(module, args, kwargs):
    given = _padding.get()
    if given is None or given[0] is not module:
        return None
    names = list(inspect.signature(module.forward).parameters)
    at = names.index("attention_mask")
    current = args[at] if at < len(args) else kwargs.get("attention_mask")
    mask = _padding_in(current, given[1])
    if at < len(args):  # passed positionally
        return args[:at] + (mask,) + args[at + 1:], kwargs
    return args, {**kwargs, "attention_mask": mask}


def _padding_in(current, real):
    """The mixer's `attention_mask` with the padding mask `real` (B, T) in: `real` itself, or, where
    the mixer takes a mapping of masks (Zaya's {"causal": ..., "conv": ...}), that mapping with
    `real` for its entries that are padding masks (2D, or None: no padding) and its attention masks
    (4D: kvwire's seam makes its own) kept."""
    if not isinstance(current, dict):
        return real
    return {k: real if v is None or (isinstance(v, torch.Tensor) and v.dim() == 2) else v for k, v in current.items()}
