"""Where kvwire's cache meets transformers' attention: an attention implementation registered with
transformers' `AttentionInterface` under the name "kvwire".

transformers' attention modules compute queries, keys and values (rotary, QK-norm, latent
projections: whatever the family does) and hand them to the configured attention function. Ours:
- outside a kvwire cached call it is the module's own eager attention, with transformers' mask;
- inside one (`attending`), for the module being called, it writes the chunk's keys/values into
  kvwire's cache for that call at each row's `cache_index` and calls the same eager attention
  over the cache as it was plus the chunk, with kvwire's mask (per-row positions, left padding,
  sliding window). The module's own function keeps its extras (sinks, soft-caps, scaling). A layer
  making several attention calls (differential attention) has a cache per call, taken in order.
"""
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...layers.attention import AttentionMath, write_chunk
from ...layers.masks import chunk_mask, slot_mask
from ...layers.shared import shared
from .scoped import Scoped

try:  # private to torch: without it, no proxies to see through
    from torch.fx.experimental.proxy_tensor import _AttrProxy
except ImportError:  # pragma: no cover - other torch versions
    _AttrProxy = ()

NAME = "kvwire"
_active = Scoped(None)
_watcher = Scoped(None)
_registered = []


@dataclass
class Attending:
    """One attention call in a cached call of one block: its module, cache pair and the call's inputs."""

    module: torch.nn.Module
    window: int
    cache: tuple
    cache_index: torch.Tensor
    attention_mask: torch.Tensor
    plain_math: bool = False  # the probe found kvwire's attention math equal to the module's


@dataclass
class _Step:
    """The attention calls a block's cached call expects, in order, and how many it made."""

    states: list
    calls: int = 0

    def next_for(self, module):
        """The state of the next expected call when `module` makes it (counted), else None."""
        if self.calls < len(self.states) and unproxied(self.states[self.calls].module) is unproxied(module):
            self.calls += 1
            return self.states[self.calls - 1]
        return None


@contextmanager
def attending(states):
    """Inside: the k-th attention call, by `states[k].module` (a list of `Attending`), reads and
    writes `states[k].cache`; yields the step, whose `calls` counts them."""
    step = _Step(list(states))
    token = _active.set(step)
    try:
        yield step
    finally:
        _active.reset(token)


@contextmanager
def watching(fn):
    """Inside: every plain attention call also calls fn(module, key, value, window, plain_math_fits)
    (the build's probe)."""
    token = _watcher.set(fn)
    try:
        yield
    finally:
        _watcher.reset(token)


def register():
    """Register "kvwire" with transformers' attention and mask interfaces (once)."""
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # plain calls get the eager function's mask
    _registered.append(True)


def eager_function(module):
    """The eager attention of the module's own modeling file (every transformers modeling file
    defines `eager_attention_forward`), or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-interface signature: query (B, H, T, d), key (B, Hkv, T, d), value
    (B, Hkv, T, d_v) -> (output (B, T, H, d_v), weights or None)."""
    eager = eager_function(module)
    step = _active.get()
    state = None if step is None else step.next_for(module)
    indices = kwargs.pop("indices", None)
    if indices is not None:  # sparse attention: an indexer picked the keys each query sees
        if state is not None:
            raise RuntimeError(f"{type(module).__name__} attends only to the keys its indexer selects (`indices`), "
                               f"scored against every past token's indexer key, which kvwire's key/value cache does "
                               f"not keep")
        attention_mask = selected(attention_mask, indices, key.shape[2], query.dtype)
    if state is None:
        out = eager(module, query, key, value, attention_mask, **kwargs)
        watcher = _watcher.get()
        if watcher is not None:
            # the window the module passes for this call (None on full layers whose module still
            # keeps the config's window), else the module's own, else one only its mask shows
            window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
            if window is None:
                window = mask_window(attention_mask, query.shape[2])
            watcher(module, key, value, window, _plain_math_fits(module, query, key, value, window, kwargs, out[0]))
        return out
    window = state.window
    if state.plain_math:  # kvwire's grouped attention: no repeated or concatenated keys and values
        core = _Core(key.shape[1], kwargs.get("scaling"), kwargs.get("softcap"), window)
        out, state.cache = core.attend_cached(query, key.float(), value.float(), state.cache, state.cache_index,
                                              state.attention_mask, query.dtype)
        return out.transpose(1, 2).to(query.dtype).contiguous(), None
    k_cache, v_cache = state.cache
    T, slots = query.shape[2], k_cache.shape[2]
    old = shared(slot_mask, state.cache_index, T, slots, window, state.attention_mask)
    new = shared(chunk_mask, state.cache_index, T, window, state.attention_mask)
    dtype = query.dtype
    bias = shared(_bias, old, new, dtype)  # (B|1, 1, T, slots + T), once per call for equal windows
    keys = torch.cat([k_cache.to(dtype), key], dim=2)
    values = torch.cat([v_cache.to(dtype), value], dim=2)
    out = eager(module, query, keys, values, bias, **kwargs)
    state.cache = write_chunk(state.cache, key.float(), value.float(), state.cache_index)
    return out


def selected(mask, indices, K, dtype):
    """The attention mask (B | 1, 1, T, K), bool or additive, also hiding every key outside
    `indices` (B, T, top-k): the keys a sparse-attention indexer picked for each query, as
    transformers' eager path folds them in."""
    B, T = indices.shape[:2]
    keep = torch.zeros(B, T, K, dtype=torch.bool, device=indices.device).scatter(-1, indices.long(), True)[:, None]
    if mask is None:
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, torch.finfo(dtype).min)


def mask_window(mask, T):
    """The sliding window w < T a probe's mask keeps (query q sees keys q - w < k <= q), else None.

    For attention modules that leave the window to the mask alone (they pass none to the attention
    function and keep none themselves): mask is transformers' mask of a T-token call without
    padding or cache, (B, 1, T, T), bool (True: seen) or additive float (0: seen). A window of T or
    more looks like full causal attention to a T-token probe, and any other pattern is not a
    window: both give None.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (T, T):
        return None
    seen = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
    i = torch.arange(T, device=mask.device)
    behind = i[:, None] - i[None, :]  # how far key k is behind query q
    if not torch.equal(seen, behind >= 0):  # not plain causal
        for w in range(1, T):
            if torch.equal(seen, (behind >= 0) & (behind < w)):
                return w
    return None


def unproxied(module):
    """The module itself where torch.export's non-strict tracer hands out a stand-in for it (an
    attribute proxy, for a module the traced tree reaches by more than one path)."""
    return module.get_base() if isinstance(module, _AttrProxy) else module


class _Core(AttentionMath):
    def __init__(self, num_kv_heads, scale, softcap, sliding_window):
        self.num_kv_heads, self.scale, self.softcap, self.sliding_window = num_kv_heads, scale, softcap, sliding_window


def _plain_math_fits(module, query, key, value, window, kwargs, expected):
    """Whether kvwire's own attention math (grouped heads, scaling, soft-cap, window) gives what the
    module's eager attention gave on this call: then cached calls may use it. A module with more
    (sinks, biases, an unusual mask) keeps its eager function."""
    if kwargs.get("scaling") is None or query.shape[1] % key.shape[1] or key.shape[2] != query.shape[2]:
        return False
    B, T = query.shape[0], query.shape[2]
    start = torch.zeros((), dtype=torch.long, device=query.device)
    mask = chunk_mask(start, T, window, torch.ones(B, T, dtype=torch.bool, device=query.device))
    core = _Core(key.shape[1], kwargs["scaling"], kwargs.get("softcap"), window)
    with torch.no_grad():
        ours = core._attend(query, [(key.float(), value.float(), mask)], query.dtype).transpose(1, 2)
    theirs = expected.float()
    return ours.shape == theirs.shape and bool(((ours - theirs).abs().max() <= 1e-5 * max(1.0, theirs.abs().max())).item())


def _bias(old, new, dtype):
    allowed = torch.cat([old, new], dim=-1)[:, None]
    # the additive mask transformers' eager functions take; its smallest value (not -inf) keeps a
    # row that sees nothing (a left pad) finite, as transformers' own masks do
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)
