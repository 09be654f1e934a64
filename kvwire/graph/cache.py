"""`kw.with_cache`: the graph pass that wires per-layer KV caches into a (possibly edited) graph.

The pass traces the module at "layer" depth and rewrites it:
- new inputs `positions` (B, T), `cache_index` (), `attention_mask` (B, max_length), `cache`
  (one (key, value) pair per cached layer call);
- every layer that needs positions is called through `forward_cached(x, positions=...)`, with
  `cache_index` and `attention_mask` too where it sets `uses_timeline`;
- every layer with a `cache_spec` is called through `forward_cached(...)` with its own cache pair,
  and its next cache is collected; a layer with `cache_parts` (several caches, a hybrid decoder
  layer's keys/values and recurrent state) gets a tuple of pairs, one slot each;
- every layer with `runtime_inputs` (an inserted steering layer, say) gets them as graph inputs
  placed after `cache`, one per name, shared by the layers that read it;
- the output becomes `(hidden, next_cache)`;
- bare block sites (`kvwire.layers.site.Site`, identities) are bypassed.
Everything else in the graph, including whatever a user inserted, is left as it was.
"""
import operator
from dataclasses import dataclass

import itertools

import torch
from torch import fx, nn

from ..layers.shared import per_call
from ..layers.site import Site
from .release import recompile
from .trace import trace

CACHE_DTYPE = torch.float32  # attention computes in float32; caches keep its keys and values


@dataclass(frozen=True)
class CacheSlot:
    """One cache of a layer call: its dotted name and the module whose `cache_spec` gives it."""

    name: str
    module: nn.Module


def _needs_cache(module):
    spec = getattr(module, "cache_spec", None)
    return spec is not None and spec(1, 1, torch.float32) is not None


def _cache_parts(module):
    """{name suffix: module whose `cache_spec` gives the slot} of a layer listing several caches in
    `cache_parts`, or None for a layer with one cache (or none)."""
    parts = dict(getattr(module, "cache_parts", None) or {})
    return parts or None


def _drop_sites(gm):
    """Bypass the bare `Site` calls (identities that only name a place in a block): the cached graph
    pays nothing for them. A tap of a site reads the value that flowed through it."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and type(gm.get_submodule(node.target)) is Site:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _rewire(gm):
    _drop_sites(gm)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(
            f"with_cache expects a module with one input (token_ids); got inputs {[p.target for p in placeholders]}")
    inputs, anchor = {}, placeholders[0]
    for name in ("positions", "cache_index", "attention_mask", "cache"):
        with graph.inserting_after(anchor):
            anchor = inputs[name] = graph.placeholder(name)
    slots, next_cache, seen, runtime, readers = [], [], {}, {}, []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        parts = _cache_parts(module)
        needs_cache = parts is not None or _needs_cache(module)
        wanted = dict(getattr(module, "runtime_inputs", {}) or {})
        if not (needs_cache or wanted or getattr(module, "uses_positions", False)):
            continue
        if needs_cache and (not node.args or node.kwargs):
            raise ValueError(f"layer {node.target!r} is called with {len(node.args)} args and kwargs "
                             f"{list(node.kwargs)}; the cache pass expects its input tensor (and any further "
                             f"inputs, a gate say) positionally")
        with graph.inserting_before(node):
            owner = graph.get_attr(node.target)
            kwargs = {"positions": inputs["positions"]}
            if getattr(module, "uses_timeline", False):  # reads where each row is in the cache, keeps none
                kwargs.update(cache_index=inputs["cache_index"], attention_mask=inputs["attention_mask"])
            for name, dtype in wanted.items():
                if name not in runtime:
                    runtime[name] = _RuntimeInput(dtype, node.target, _add_input(graph, name))
                elif runtime[name].dtype != dtype:
                    raise ValueError(f"layer {node.target!r} reads runtime input {name!r} as {dtype}; "
                                     f"layer {runtime[name].first!r} reads it as {runtime[name].dtype}")
                kwargs[name] = runtime[name].node
            if wanted and module not in readers:
                readers.append(module)
            if needs_cache:
                count = seen[node.target] = seen.get(node.target, 0) + 1
                name = node.target if count == 1 else f"{node.target}#{count}"
                owners = {"": module} if parts is None else parts
                pairs = [graph.call_function(operator.getitem, (inputs["cache"], len(slots) + k))
                         for k in range(len(owners))]
                kwargs.update(cache_index=inputs["cache_index"], attention_mask=inputs["attention_mask"],
                              cache=pairs[0] if parts is None else tuple(pairs))
                result = graph.call_method("forward_cached", (owner, *node.args), kwargs)
                out = graph.call_function(operator.getitem, (result, 0))
                given = graph.call_function(operator.getitem, (result, 1))
                if parts is None:
                    next_cache.append(given)
                else:  # one next pair per part, in the parts' order
                    next_cache += [graph.call_function(operator.getitem, (given, k)) for k in range(len(owners))]
                slots += [CacheSlot(f"{name}.{suffix}" if suffix else name, part) for suffix, part in owners.items()]
            else:
                # other inputs (a gate read at another site, say) pass through as they were
                out = graph.call_method("forward_cached", (owner, *node.args), {**node.kwargs, **kwargs})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0], tuple(next_cache)),)
    graph.lint()
    return slots, {name: r.dtype for name, r in runtime.items()}, readers


@dataclass
class _RuntimeInput:
    dtype: torch.dtype
    first: str  # the first layer call that reads it
    node: fx.Node


def _add_input(graph, name):
    """A new placeholder after the last one (inputs keep the order in which layers ask for them)."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        return graph.placeholder(name)


class CachedGraph(nn.Module):
    """The cached form of a layer graph: one static-shape function for prefill and decode.

    Call: `(token_ids (B, T) int64, positions (B, T) int64, cache_index () or (B,) int64,
    attention_mask (B, max_length) bool, cache)` -> `(hidden (B, T, D), next_cache)`, where
    cache_index is where the chunk's first token is written, for the batch or per row (the
    engine's rows join a running batch at different times; exported graphs take one for the batch);
    `cache` is a tuple with one `(key, value)` pair per slot (`self.slots`: a cached layer call,
    or each of its `cache_parts`), each (B, kv_heads, slots, head_dim). In eager mode the caches are updated in place and returned.
    Callers of the raw `graph_module` should enter `kvwire.layers.shared.per_call()` around each
    call, as this module does, so layers share their masks and rotary tables.
    Layers that read runtime inputs (`self.runtime_inputs`, {name: dtype}) add one (B,) input each
    after `cache`, given by keyword; left out, they take the layers' defaults (`default_inputs`).
    Calling the module checks its inputs; `self.graph_module` is the raw graph for export/compile
    (runtime inputs positional after `cache`).

    Example:
        >>> cached = kw.with_cache(backbone)
        >>> cache = cached.init_cache(1, 64)
        >>> mask = torch.ones(1, 64, dtype=torch.bool)
        >>> h, cache = cached(ids, torch.arange(5)[None], torch.tensor(0), mask, cache)
    """

    def __init__(self, graph_module, slots, runtime_inputs=None, readers=()):
        super().__init__()
        self.graph_module = graph_module
        self.slots = tuple(slots)
        self.runtime_inputs = dict(runtime_inputs or {})
        self._readers = list(readers)

    row_index = True  # takes a (B,) cache_index (exported runtimes take a scalar only)

    @property
    def readers(self):
        """The layers that read runtime inputs, in the order the graph first calls them."""
        return tuple(self._readers)

    def default_inputs(self, batch_size, prompt_lengths=None):
        """The runtime inputs' default values for a batch: {name: (batch_size,) tensor}.

        prompt_lengths: (B,) prompt lengths when generating (a layer may act on generated tokens only).
        """
        values, first = {}, {}
        for layer in self._readers:
            for name, value in layer.runtime_defaults(batch_size, prompt_lengths).items():
                if name in values and not torch.equal(values[name], value):
                    # one graph input cannot carry two defaults: the first would win silently
                    raise ValueError(f"layers {first[name]} and {type(layer).__name__} share runtime input "
                                     f"{name!r} but default it to {values[name].tolist()} and {value.tolist()}; "
                                     f"give them different names")
                values.setdefault(name, value)
                first.setdefault(name, type(layer).__name__)
        return {name: values[name] for name in self.runtime_inputs}

    @property
    def names(self):
        """Dotted names of the cached layer calls, in cache order."""
        return [s.name for s in self.slots]

    def init_cache(self, batch_size, max_length, dtype=None, device=None):
        """Zeroed per-layer caches for `batch_size` rows and `max_length` tokens, float32 (the
        only dtype the layers use: attention computes in float32; `dtype` is accepted as float32 or
        None), on the device of each cached layer's weights unless `device` is given. A
        sliding-window layer gets a ring of window - 1 slots, not max_length.
        """
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size} and {max_length}")
        if dtype not in (None, CACHE_DTYPE):
            raise ValueError(f"init_cache(dtype={dtype}): the cached layers keep keys and values in {CACHE_DTYPE} "
                             f"whatever the weights' dtype (attention computes in float32); leave dtype out")
        cache = []
        for slot in self.slots:
            # a layer whose projections are all ggml blocks holds buffers only (and may hold neither)
            tensor = next(itertools.chain(slot.module.parameters(), slot.module.buffers()), None)
            dt = CACHE_DTYPE
            k_shape, v_shape = slot.module.cache_spec(batch_size, max_length, dt)
            dev = device or (tensor.device if tensor is not None else "cpu")
            cache.append((torch.zeros(k_shape, dtype=dt, device=dev), torch.zeros(v_shape, dtype=dt, device=dev)))
        return tuple(cache)

    def forward(self, token_ids, positions, cache_index, attention_mask, cache, **inputs):
        cache_index = self.check_call(token_ids, positions, cache_index, attention_mask, cache)
        extra = self.runtime_values(token_ids.shape[0], inputs)
        with per_call():  # layers share masks and rotary tables within the call
            return self.graph_module(token_ids, positions, cache_index, attention_mask, cache, *extra)

    def check_call(self, token_ids, positions, cache_index, attention_mask, cache):
        """Validate a call's inputs (what `forward` checks); returns cache_index as a 0-d tensor."""
        return _check_inputs(self, token_ids, positions, cache_index, attention_mask, cache)

    def runtime_values(self, batch_size, inputs):
        """The runtime inputs ({name: (B,) tensor}, defaults for those left out) in graph order."""
        unknown = set(inputs) - set(self.runtime_inputs)
        if unknown:
            raise TypeError(f"unknown runtime inputs {sorted(unknown)}; this graph takes "
                            f"{sorted(self.runtime_inputs) or 'none'}")
        defaults = self.default_inputs(batch_size) if len(inputs) < len(self.runtime_inputs) else {}
        values = []
        for name, dtype in self.runtime_inputs.items():
            value = inputs.get(name, defaults.get(name))
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != (batch_size,):
                got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                    else type(value).__name__
                raise TypeError(f"runtime input {name!r} must be a {dtype} tensor of shape ({batch_size},); got {got}")
            values.append(value)
        return values


def _check_inputs(cached, token_ids, positions, cache_index, attention_mask, cache):
    """Validate a call of the cached graph at the boundary; returns cache_index as a 0-d tensor."""
    for name, t in (("token_ids", token_ids), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) or t.dim() != 2:
            got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int64 tensor (B, T); got {got}")
    if positions.shape != token_ids.shape:
        raise ValueError(f"positions shape {tuple(positions.shape)} != token_ids shape {tuple(token_ids.shape)}")
    B, T = token_ids.shape
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool \
            or attention_mask.dim() != 2 or attention_mask.shape[0] != B:
        got = f"{attention_mask.dtype} {tuple(attention_mask.shape)}" if isinstance(attention_mask, torch.Tensor) \
            else type(attention_mask).__name__
        raise TypeError(f"attention_mask must be a bool tensor (B={B}, max_length); got {got}")
    max_length = attention_mask.shape[1]
    index = cache_index if isinstance(cache_index, torch.Tensor) else \
        torch.tensor(operator.index(cache_index), device="cpu")
    if index.dtype not in (torch.int64, torch.int32) or index.dim() > 1 or (index.dim() == 1 and index.shape[0] != B):
        raise TypeError(f"cache_index must be an int (one write index) or an int64 tensor of shape () or "
                        f"(B={B},) (one per row); got {index.dtype} of shape {tuple(index.shape)}")
    if len(cache) != len(cached.slots):
        raise ValueError(f"cache has {len(cache)} layer entries; this graph has {len(cached.slots)} cached layers")
    for slot, pair in zip(cached.slots, cache):
        k_shape, v_shape = slot.module.cache_spec(B, max_length, None)
        if len(pair) != 2 or tuple(pair[0].shape) != tuple(k_shape) or tuple(pair[1].shape) != tuple(v_shape):
            got = [tuple(t.shape) for t in pair]
            want = tuple(k_shape) if tuple(k_shape) == tuple(v_shape) else f"{tuple(k_shape)} and {tuple(v_shape)}"
            raise ValueError(f"cache of {slot.name!r} must be (key, value) of shape {want}; got {got}")
        if any(t.dtype != CACHE_DTYPE for t in pair):
            raise TypeError(f"cache of {slot.name!r} must be {CACHE_DTYPE}; got {[t.dtype for t in pair]} "
                            f"(make caches with init_cache)")
    device = attention_mask.device  # every tensor input on one device: masks and indices are built there
    stray = [(name, t.device) for name, t in (("token_ids", token_ids), ("positions", positions))
             if t.device != device]
    stray += [(f"cache of {slot.name!r}", t.device) for slot, pair in zip(cached.slots, cache) for t in pair
              if t.device != device]
    weight = next(cached.slots[0].module.parameters(), None) if cached.slots else None
    if weight is not None and weight.device != device:
        stray.append((f"the weights of {cached.slots[0].name!r}", weight.device))
    if stray:
        raise ValueError(f"inputs on different devices: attention_mask is on {device} but {stray[0][0]} is on "
                         f"{stray[0][1]}; give every input (and caches from init_cache) on the model's device")
    low, high = (int(index), int(index)) if index.dim() == 0 else (int(index.min()), int(index.max()))
    if low < 0 or high + T > max_length:
        at = low if low < 0 else high
        raise ValueError(f"chunk of {T} tokens at cache_index {at} does not fit max_length {max_length}")
    return index.to(dtype=torch.int64, device=device)


def with_cache(module):
    """Wire per-layer KV caches into `module`'s layer graph (the graph pass at kvwire's core).

    Args:
        module: a backbone mapping token_ids (B, T) -> hidden (B, T, D), or any clone of one.

    Returns a `CachedGraph`: see its docstring for the call contract. Edits made with `clone` are
    part of the traced graph and so are kept. Weights are shared with `module`.

    Example:
        >>> cached = kw.with_cache(kw.clone(backbone, fn))
        >>> cached.names[:2]
        ['layers.0.self_attn', 'layers.1.self_attn']
    """
    gm = trace(module, depth="layer")
    slots, runtime_inputs, readers = _rewire(gm)
    recompile(gm)
    return CachedGraph(gm, slots, runtime_inputs, readers)
