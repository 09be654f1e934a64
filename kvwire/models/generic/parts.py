"""A transformers decoder as kvwire layers: its own modules, split at its decoder layers.

    token_ids -> Prelude -> layers.0 ... layers.N-1 -> Tail -> hidden      (Head: hidden -> logits)

`Prelude` runs the model's own forward with every decoder layer swapped for a recorder: whatever
the family computes before and between its layers (embeddings and their scaling, rotary tables
for the given positions, per-layer inputs) happens as transformers writes it, and the recorders
keep the arguments each layer was called with. Each `DecoderLayer` then calls its transformers
layer with its recorded arguments. `Tail` is what the forward applies after the last layer (the
final norm). The arguments travel from the prelude to the layers through a per-call context, so
the layer graph between them stays plain tensors: insert, tap, steer and cache it as any other.
"""
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ...layers.base import Block, Layer
from ...layers.inner import InnerSites
from ...layers.shared import shared
from . import handed, held, rerun, seam, sites, state as state_slots, stepping, timeline
from .arguments import with_arguments
from .scoped import Scoped

_calls = Scoped(None)
# the token ids of the running prelude call: a `ReplayTail` replays the forward on them
_tokens = Scoped(None)
# {index: the tuple decoder layer `index` returned} in the running call: what a layer hands the next
# one beside its hidden states (Zaya's router states), read by layers with `carried` arguments
_outputs = Scoped(None)
# the arguments the prelude recorded for a rerun's packed window (`kvwire.models.generic.rerun`):
# the same store as `_calls` where every layer reruns, another where some keep their caches
_window_calls = Scoped(None)


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` during the prelude: keeps its input and arguments, returns
    its input (in a tuple as long as the layer's own, `returns_tuple`, where it returns one). What
    the model's forward reads from its layers (a block type, say) it reads from the layer itself."""

    def __init__(self, index, returns_tuple, layer=None):
        super().__init__()
        self.index, self.returns_tuple = index, int(returns_tuple)
        self.__dict__["layer"] = layer  # not a submodule: its weights belong to the backbone's parts

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("layer")
            if layer is None:
                raise
            return getattr(layer, name)

    def forward(self, *args, **kwargs):
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        _calls.get()[self.index] = (hidden, args, kwargs)  # the running prelude's store
        return self.returned(hidden)

    def returned(self, hidden):
        """What the layer's own forward would return around `hidden`: a tuple as long as its own, or
        the tensor."""
        return (hidden,) + (None,) * (self.returns_tuple - 1) if self.returns_tuple else hidden


def swap_layers(base, layers_name, modules):
    """Put `modules` where `base` holds its decoder layers (`layers_name`, a dotted path: the list may
    sit inside a child of the base model, GIT's `encoder.layer`); returns what was there."""
    owner, _, leaf = layers_name.rpartition(".")
    owner = base.get_submodule(owner) if owner else base
    held = getattr(owner, leaf)
    setattr(owner, leaf, modules)
    return held


def cache_argument(base):
    """The name under which the base model's forward takes a transformers cache."""
    names = inspect.signature(base.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def recorded_calls():
    """[(hidden, args, kwargs)] per decoder layer, as the last prelude call in this context recorded them."""
    return _calls.get()


class Prelude(Layer):
    """token_ids (B, T) -> the hidden states (B, T, D) the first decoder layer takes, running the
    model's forward with recorders in place of its layers (see the module docstring).

    Args:
        base: the transformers base model (its forward takes input_ids and position_ids).
        layers_name: the path in `base` of its decoder layers (a ModuleList; dotted where a child holds them).
        returns_tuple: whether the layers return tuples (older families) rather than tensors.
    """

    uses_positions = True
    # set by the build where a decoder layer attends through transformers' Cache API: cached calls
    # then take cache_index and attention_mask too, and run the forward with a timeline cache
    uses_timeline = False

    def __init__(self, base, layers_name, returns_tuple, uncalled=()):
        super().__init__()
        self.__dict__["base"] = base  # not a submodule: its weights belong to the backbone's parts
        self.layers_name, self.returns_tuple = layers_name, returns_tuple
        self.uncalled = set(uncalled)  # layers the forward skips on text (`UncalledLayer`)
        self.cache_layers = 0  # the transformers cache layers a timeline cache holds
        self.cache_name = cache_argument(base)  # the forward's cache argument (read once, not a step)
        # made once: a call only swaps them in (not a submodule: they hold no weights)
        self.__dict__["recorders"] = nn.ModuleList(_Recorder(i, returns_tuple, layer)
                                                   for i, layer in enumerate(base.get_submodule(layers_name)))

    def forward(self, token_ids):
        B, T = token_ids.shape
        positions = torch.arange(T, device=token_ids.device)[None].expand(B, T)
        return self._record(token_ids, positions)

    # set by the build where the forward does more with the timeline's 2D padding mask than mask by it
    # (GIT widens it by an image's tokens once the cache holds some): the forward gets it finished
    # (4D, `timeline.finished_mask`), which transformers' mask functions pass on as they find it
    finished_mask = False

    @property
    def stem_dtype(self):
        """The dtype of the base model's weights (a finished mask's)."""
        return next(self.base.parameters()).dtype

    # set by the build where the cache pass does not fit the model (`kvwire.models.generic.rerun`):
    # cached calls keep the token ids and run the forward over each row's whole history
    reruns = False
    # set by the build where only some layers rerun: the forward runs over the chunk too, for the
    # arguments of the layers keeping their caches
    partly = False

    def cache_spec(self, batch_size, max_length, dtype):
        """The token ids' slot of a model whose layers rerun over their inputs, else None."""
        return rerun.spec(batch_size, max_length, (1,)) if self.reruns else None

    def forward_cached(self, token_ids, *, positions, cache_index=None, attention_mask=None, cache=None):
        if self.reruns:
            return self._rerun(token_ids, positions, cache_index, attention_mask, cache)
        return self._record(token_ids, positions, cache_index, attention_mask)

    def _rerun(self, token_ids, positions, cache_index, attention_mask, cache):
        """(the chunk's hidden states (B, T, D), next ids slot): the forward over each row's packed
        history (`kvwire.models.generic.rerun`), its layers' arguments recorded for that window;
        where some layers keep their caches (`partly`), over the chunk too, for theirs."""
        B, T = token_ids.shape
        cache = rerun.write(cache, token_ids[..., None], cache_index)
        source, chunk, real = shared(rerun.packing, cache_index, T, attention_mask)
        ids = rerun.window(cache, source)[..., 0].to(torch.long)
        window = self._record(ids, shared(rerun.positions, real))
        _window_calls.set(_calls.get())
        if self.partly:  # the cached layers' arguments, and the chunk's hidden states, from its own call
            return self._record(token_ids, positions, cache_index, attention_mask), cache
        _tokens.set(token_ids)  # a `ReplayTail` runs on the chunk
        return rerun.chunk_of(window, chunk), cache

    def _record(self, token_ids, positions, cache_index=None, attention_mask=None):
        store = [None] * len(self.recorders)
        _calls.set(store)  # the recorders fill it; the decoder layers read it
        _tokens.set(token_ids)
        _outputs.set({})
        kwargs = {"use_cache": False}
        if self.uses_timeline and cache_index is not None:
            # the forward as transformers runs it with a cache: masks and biases over the timeline's
            # columns (`kvwire.models.generic.timeline`), the cache handed to the layers that update it
            mask = timeline.padding_mask(cache_index, token_ids.shape[1], attention_mask)
            if self.finished_mask:
                mask = timeline.finished_mask(mask, token_ids.shape[1], self.stem_dtype)
            kwargs = {"use_cache": True, "attention_mask": mask,
                      self.cache_name: timeline.timeline_cache(self.cache_layers, attention_mask.shape[1])}
        layers = swap_layers(self.base, self.layers_name, self.recorders)
        try:
            self.base(input_ids=token_ids, position_ids=positions, **kwargs)
        finally:
            swap_layers(self.base, self.layers_name, layers)
        missing = [i for i, call in enumerate(store) if call is None and i not in self.uncalled]
        if missing:
            raise RuntimeError(f"{type(self.base).__name__}'s forward did not call decoder layers {missing[:8]}")
        return store[0][0]


@dataclass
class AttentionCall:
    """One attention call of a decoder layer as the build's probe saw it: the path of the
    transformers module making it inside the layer ("" the layer itself; a path, not the module, so
    copies and shells of the layer resolve their own), its key heads, key and value sizes, sliding
    window (None: full) and whether kvwire's attention math gave the module's own output (`seam`).
    A call `through_cache` is a module that computes attention itself over what transformers'
    Cache API returns it (`kvwire.models.generic.timeline`), not through the attention interface."""

    path: str
    kv_heads: int
    key_size: int
    value_size: int
    window: int = None
    plain_math: bool = False
    through_cache: bool = False
    indexer_size: int = None  # a sparse-attention indexer's key size, where it keeps keys in the Cache API too

    def cache_spec(self, batch_size, max_length):
        """(key shape, value shape): (B, key heads, slots, size), slots the window - 1 of a sliding
        call or max_length."""
        slots = max_length if self.window is None else max(1, min(self.window - 1, max_length))
        return ((batch_size, self.kv_heads, slots, self.key_size), (batch_size, self.kv_heads, slots, self.value_size))


class DecoderLayer(InnerSites, Block):
    """transformers' decoder layer `index`, called with the arguments the prelude recorded: a block
    (control vectors and `layers.N` selectors count it) that is one node at every depth.

    Its inner sites (`kvwire.layers.inner`; found by the build, `kvwire.models.generic.sites`) are
    "resid_pre" and, where the layer has them, "attn_out", "resid_mid", "mlp_out", "attn_heads":
    what is put there runs inside the transformers layer's call.

    Each attention call of the layer (`calls`, `AttentionCall`s found by the build's probe, in call
    order; most layers make one, a differential-attention layer two) reads and writes its own cache
    in the cached graph: (B, key heads, slots, key size) and (..., value size), slots the window - 1
    of a sliding call or max_length. A layer whose mixer keeps recurrent state instead (`states`, a
    `kvwire.models.generic.state.StateCache`) holds a state slot: (B, 1, 1, conv sizes) and (B, 1, 1,
    recurrent sizes), read and written through transformers' Cache API (or kept in its modules'
    attributes, a cache object of the model's own class or an argument the model's forward hands
    it: `kvwire.models.generic.held`, `owned`, `handed`). A layer with several caches
    lists them in `cache_parts`: "attention", "attention2", ..., then "state".
    """

    def __init__(self, layer, index, calls=(), states=None):
        super().__init__()
        self.block, self.index, self.states = layer, index, states
        self.__dict__["mixer"] = None  # a stateful layer's token mixer (a submodule of block; found by the build)
        self.calls = list(calls)
        # [(k, argument)]: element k of the previous layer's returned tuple is this layer's argument
        # (a position after the hidden states, or a keyword): found by the build's probe
        self.carried = []
        self.hands_on = False  # whether the next layer carries some of what this one returns
        self.inner_sites, self.points, self.width, self.heads_width = ("resid_pre",), {}, None, None
        self.rerun_shape = None  # (D,) where the layer reruns over its kept inputs (`kvwire.models.generic.rerun`)
        # the factor the model's forward scales the previous layer's output by before this layer
        # (RWKV halves its hidden states every `rescale_every` layers): found by the build, None for none
        self.scale_in = None

    @property
    def attention(self):
        """The module making the layer's first attention call (a submodule of block), or None."""
        return self.block.get_submodule(self.calls[0].path) if self.calls else None

    @property
    def window(self):
        """The first attention call's sliding window (None: full attention, or no attention)."""
        return self.calls[0].window if self.calls else None

    @property
    def plain_math(self):
        """Whether cached calls use kvwire's attention math (the probe found it equal, every call)."""
        return bool(self.calls) and all(call.plain_math for call in self.calls)

    @plain_math.setter
    def plain_math(self, value):
        for call in self.calls:
            call.plain_math = bool(value)

    opaque = True

    def found_sites(self, points, width, heads_width):
        """Record the inner sites the build found: points {site: (module, "output" | "input")}, the
        residual width and the heads' width (None without an "attn_heads" site)."""
        self.points, self.width, self.heads_width = dict(points), width, heads_width
        self.inner_sites = ("resid_pre", *(s for s in ("attn_out", "resid_mid", "mlp_out", "attn_heads") if s in points))

    def site_width(self, site):
        return self.heads_width if site == "attn_heads" else self.width

    @property
    def weights_dtype(self):
        """The dtype of the layer's floating weights: that of the states that follow the model (the
        hidden states between layers may be another: Mamba keeps its residual in float32)."""
        return next((p.dtype for p in self.block.parameters() if p.is_floating_point()), torch.float32)

    @property
    def head_size(self):
        """Columns per head at "attn_heads": the first attention call's value size."""
        return self.calls[0].value_size if self.calls else None

    def forward(self, x, gate=None):
        return self._run(self._scaled(x), None, None, gate)

    def _scaled(self, x):
        """x as the model's forward hands it to this layer: `scale_in` applied (before "resid_pre")."""
        return x if self.scale_in is None else x * self.scale_in

    def _run(self, x, positions, inputs, gate=None, given=None):
        calls = _calls.get()
        if calls is None:
            raise RuntimeError("a generic decoder layer runs after its model's Prelude (it takes the layer's "
                               "arguments from it); call the whole backbone")
        args, kwargs = self.arguments(calls)
        if given:
            args, kwargs = with_arguments(self.block, args, kwargs, given)
        x = self.edit_at("resid_pre", x, positions, inputs, gate)
        return self._call(x, args, kwargs, positions, inputs, gate)

    def arguments(self, calls):
        """(args, kwargs) of this layer's call: the prelude's record, with what the previous layer
        returned beside its hidden states where the layer takes that (`carried`)."""
        _, args, kwargs = calls[self.index]
        outputs = _outputs.get()
        if not self.carried or outputs is None or self.index - 1 not in outputs:
            return args, kwargs
        previous = outputs[self.index - 1]
        args, kwargs = list(args), dict(kwargs)
        for k, at in self.carried:
            if isinstance(at, int):
                args[at] = previous[k]
            else:
                kwargs[at] = previous[k]
        return tuple(args), kwargs

    def _call(self, x, args, kwargs, positions, inputs, gate, whole=False):
        """The transformers layer on x (B, T, D), its inner sites' edits in place; a tuple it returns
        is kept for the next layer (`carried`), and returned whole with `whole`."""
        if any(site != "resid_pre" for site in self.edits):
            with sites.running(self, x, positions, inputs, gate):
                out = self.block(x, *args, **kwargs)
        else:
            out = self.block(x, *args, **kwargs)
        if not isinstance(out, (tuple, list)):
            return out
        outputs = _outputs.get()
        if self.hands_on and outputs is not None:
            outputs[self.index] = out
        return out if whole else out[0]

    def cache_spec(self, batch_size, max_length, dtype):
        """The first attention call's (key, value) shapes, else the state slot's, else None; a layer
        rerunning over its inputs keeps them instead (a `rerun_shape` tensor a token)."""
        if self.rerun_shape is not None:
            return rerun.spec(batch_size, max_length, self.rerun_shape)
        if self.attention is None:
            return None if self.states is None else state_slots.spec(self.states.states, batch_size)
        return self.calls[0].cache_spec(batch_size, max_length)

    @property
    def cache_parts(self):
        """{"attention": this layer, "attention2": its second call's cache, ..., "state": its state
        slot} for a layer keeping more than one cache, else None (one rerunning keeps its inputs)."""
        if self.rerun_shape is not None or self._slots < 2:
            return None
        parts = {"attention": self}
        parts.update({f"attention{k + 1}": _AttentionPart(self, k) for k in range(1, len(self.calls))})
        if self.calls[0].indexer_size is not None:
            parts["indexer"] = _IndexerPart(self)
        if self.states is not None:
            parts["state"] = _StatePart(self)
        return parts

    @property
    def _slots(self):
        """How many cache slots the layer's calls and state keep (a plain count: `cache_parts` builds
        modules, too much for every step)."""
        indexer = bool(self.calls) and self.calls[0].indexer_size is not None
        return len(self.calls) + (self.states is not None) + indexer

    def forward_cached(self, x, gate=None, *, positions, cache_index=None, attention_mask=None, cache=None,
                       **inputs):
        x = self._scaled(x)
        if self.rerun_shape is not None:
            return self._rerun(x, gate, positions, inputs, cache, cache_index, attention_mask)
        if self.attention is None and self.states is None:  # nothing to cache (a feed-forward block)
            return self._run(x, positions, inputs, gate)
        if self.attention is None:
            return self._with_state(x, gate, positions, inputs, cache, cache_index, attention_mask)
        if self.calls[0].through_cache:
            pair, indexer = (cache, None) if self.calls[0].indexer_size is None else cache
            with timeline.handing(timeline.Handing(pair, cache_index, indexer)) as state:
                out = self._run(x, positions, inputs, gate)
            if state.calls != 1 or state.indexer_calls != (indexer is not None):
                raise RuntimeError(f"decoder layer {self.index} wrote {state.calls} key/value pairs and "
                                   f"{state.indexer_calls} indexer keys to its cache in one step; the build's probe saw "
                                   f"one{' of each' if indexer is not None else ' pair'}")
            return (out, state.cache) if indexer is None else (out, (state.cache, state.indexer))
        parts = [cache] if self._slots < 2 else list(cache)  # the caches in `cache_parts` order
        slot = parts.pop() if self.states is not None else None
        states = [seam.Attending(self.block.get_submodule(call.path), call.window, pair, cache_index, attention_mask,
                                 call.plain_math) for call, pair in zip(self.calls, parts)]
        with seam.attending(states) as step:
            if slot is None:
                out = self._run(x, positions, inputs, gate)
            else:
                out, slot = self._with_state(x, gate, positions, inputs, slot, cache_index, attention_mask)
        if step.calls != len(states):
            raise RuntimeError(f"decoder layer {self.index} made {step.calls} attention calls in one step; its "
                               f"cache holds {len(states)} (the probe's)")
        caches = [state.cache for state in states] + ([slot] if slot is not None else [])
        return (out, caches[0]) if len(caches) == 1 else (out, tuple(caches))

    def _rerun(self, x, gate, positions, inputs, slot, cache_index, attention_mask):
        """(out, next slot) of a layer rerunning over its inputs (`kvwire.models.generic.rerun`): the
        chunk, through "resid_pre", joins the inputs the layer keeps, and the layer runs over each
        row's packed history with the arguments the prelude recorded for it."""
        calls = _window_calls.get()
        x = self.edit_at("resid_pre", x, positions, inputs, gate)
        slot = rerun.write(slot, x, cache_index, gate)  # each token's gate too: edits inside rerun with it
        source, chunk, real = shared(rerun.packing, cache_index, x.shape[1], attention_mask)
        history = rerun.window(slot, source, x.shape[2:]).to(x.dtype)
        args, kwargs = self.arguments(calls)
        gates = None if gate is None else rerun.gates(slot, source)
        out = self._call(history, args, kwargs, shared(rerun.positions, real), inputs, gates)
        return rerun.chunk_of(out, chunk), slot

    def _with_state(self, x, gate, positions, inputs, slot, cache_index, attention_mask):
        """(out, next state slot): the layer's own mixer continues its state; the chunk's padding
        mask keeps pads out of it. A mixer whose multi-token call ignores a previous state goes
        token by token in a chunk that continues one (`kvwire.models.generic.stepping`)."""
        if isinstance(self.states, held.HeldStates):
            return self._with_held(x, gate, positions, inputs, slot, cache_index, attention_mask)
        if isinstance(self.states, handed.HandedStates):
            return self._with_handed(x, gate, positions, inputs, slot, cache_index, attention_mask)
        real, fresh = state_slots.fresh_rows(positions, cache_index, attention_mask)
        steps = self.states.steps and stepping.continues(fresh, x.shape[1], self.mixer)
        opened = self.states.open(slot, 1.0 - fresh, steps, self.weights_dtype)
        given = {"cache": opened, **({"use_cache": True} if self.states.use_cache else {})}
        if self.attention is None:
            out = self._run(x, positions, inputs, gate, {**given, "attention_mask": real.to(torch.long)})
        else:  # the layer's attention_mask is its attention's: the mixer takes the padding mask itself
            with state_slots.padding(self.mixer, real.to(torch.long)):
                out = self._run(x, positions, inputs, gate, given)
        return out, self.states.close(opened, slot)

    def _with_held(self, x, gate, positions, inputs, slot, cache_index, attention_mask):
        """(out, next state slot) of a layer whose mixer keeps its state in its modules' attributes
        (`kvwire.models.generic.held`): the slot in them for the call, which runs with use_cache."""
        real, _ = state_slots.fresh_rows(positions, cache_index, attention_mask)
        starts = real * (positions == 0).to(torch.float32)
        with self.states.holding(self.block, slot, real, starts, self.weights_dtype) as left:
            out = self._run(x, positions, inputs, gate, {"use_cache": True})
        return out, left[0]

    def _with_handed(self, x, gate, positions, inputs, slot, cache_index, attention_mask):
        """(out, next state slot) of a layer handed its state as an argument
        (`kvwire.models.generic.handed`): the argument built from the slot, a call of one token at a
        time where a row starts late in the chunk (its sites' edits with that token's positions)."""
        real, _ = state_slots.fresh_rows(positions, cache_index, attention_mask)
        starts = real * (positions == 0).to(torch.float32)
        x = self.edit_at("resid_pre", x, positions, inputs, gate)
        args, kwargs = self.arguments(_calls.get())
        B, T = positions.shape

        def call(x_t, t, given, row=None):
            a, k, p, i, g = list(args), dict(kwargs), positions, dict(inputs), gate
            if t is not None:  # token t of the chunk
                a, k, i = ([stepping.at_token(v, B, T, t) for v in a], _each(k, stepping.at_token, B, T, t),
                           _each(i, stepping.at_token, B, T, t))
                p, g = p[:, t:t + 1], None if g is None else g[:, t:t + 1]
            if row is not None:  # row `row` alone
                a, k, i = [stepping.at_row(v, B, row) for v in a], _each(k, stepping.at_row, B, row), \
                    _each(i, stepping.at_row, B, row)
                p, g = p[row:row + 1], None if g is None else g[row:row + 1]
            return self._call(x_t, *with_arguments(self.block, tuple(a), k, given), p, i, g, whole=True)

        return self.states.run(call, x, slot, real, starts, self.weights_dtype, who=self.block)


def _each(values, at, *where):
    """{name: at(value, *where)} of a mapping of arguments."""
    return {name: at(value, *where) for name, value in values.items()}


class UncalledLayer(DecoderLayer):
    """A decoder layer the model's forward does not call on a text prompt (Mllama's cross-attention
    layers, skipped without image states): the identity, as in transformers, with its
    "resid_pre" site, so `layers.N` selectors keep counting it."""

    def _run(self, x, positions, inputs, gate=None, given=None):
        return self.edit_at("resid_pre", x, positions, inputs, gate)

    def forward_cached(self, x, gate=None, *, positions, **inputs):
        return self._run(x, positions, inputs, gate)


class _AttentionPart(nn.Module):
    """The cache of a decoder layer's attention call `k` after its first (a further cache part): its
    `cache_spec`, and the layer's weights (whose device the cache is made on)."""

    def __init__(self, layer, k):
        super().__init__()
        self.layer, self.k = layer, k  # a submodule here only: parameters() finds the layer's device

    def cache_spec(self, batch_size, max_length, dtype):
        return self.layer.calls[self.k].cache_spec(batch_size, max_length)


class _IndexerPart(nn.Module):
    """The indexer key slot of a decoder layer whose sparse attention scores every past token
    (DeepSeek V3.2's DSA): (B, 1, max_length, indexer key size), beside its keys and values."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer  # a submodule here only: parameters() finds the layer's device

    def cache_spec(self, batch_size, max_length, dtype):
        return (batch_size, 1, max_length, self.layer.calls[0].indexer_size), (batch_size, 1, max_length, 1)


class _StatePart(nn.Module):
    """The state slot of a decoder layer that also caches keys/values (its second cache part):
    its `cache_spec`, and the layer's weights (whose device the slot is made on)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer  # a submodule here only: parameters() finds the layer's device

    def cache_spec(self, batch_size, max_length, dtype):
        return state_slots.spec(self.layer.states.states, batch_size)


class Tail(Layer):
    """What the model's forward applies after its last decoder layer (the final norm): the base
    model's children the build's probe saw called after the layers, in order."""

    def __init__(self, modules):
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, x):
        for part in self.parts:
            x = part(x)
        return x


class _Replayer(_Recorder):
    """Stands in for decoder layer `index` during a `ReplayTail`'s run: the last layer returns the
    tail's input (`value`, set for the run), the others what they were given."""

    def __init__(self, index, returns_tuple, layer, last):
        super().__init__(index, returns_tuple, layer)
        self.last, self.value = last, None

    def forward(self, *args, **kwargs):
        return self.returned(self.value if self.last else (args[0] if args else kwargs["hidden_states"]))


class ReplayTail(Layer):
    """hidden after the last decoder layer -> the base model's output, by running the model's
    forward again with stand-ins for its layers, the last returning `hidden`: what the forward does
    after its layers (Gemma 3n's AltUp unembedding and averaging, not just modules one after
    another) runs as transformers writes it. The forward's input ids are zeros and its positions the
    step's; code after the layers that reads what came before them is not reproduced, which the
    build's logits check catches. Costs a second run of the forward's code outside the layers.

    Args:
        base, layers_name, returns_tuple: as `Prelude`'s.
    """

    uses_positions = True

    def __init__(self, base, layers_name, returns_tuple):
        super().__init__()
        self.__dict__["base"] = base  # not a submodule: its weights belong to the backbone's parts
        self.layers_name = layers_name
        layers = base.get_submodule(layers_name)
        self.__dict__["replayers"] = nn.ModuleList(_Replayer(i, returns_tuple, layer, i == len(layers) - 1)
                                                   for i, layer in enumerate(layers))

    def forward(self, x):
        B, T = _batch_and_length(x)
        return self.forward_cached(x, positions=torch.arange(T, device=x.device)[None].expand(B, T))

    def forward_cached(self, x, *, positions):
        self.replayers[-1].value = x
        layers = swap_layers(self.base, self.layers_name, self.replayers)
        try:
            ids = _tokens.get()
            if ids is None or ids.shape != positions.shape:
                ids = torch.zeros_like(positions)
            out = self.base(input_ids=ids, position_ids=positions, use_cache=False)
        finally:
            swap_layers(self.base, self.layers_name, layers)
            self.replayers[-1].value = None
        return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _batch_and_length(x):
    """(B, T) of hidden states between decoder layers: (B, T, D), or (S, B, T, D) where a family
    carries several streams (Gemma 3n's AltUp)."""
    return tuple(x.shape[-3:-1])


class Head(Layer):
    """hidden (B, T, D) -> logits (B, T, V) as the transformers model computes them: its output
    embedding, then whatever its forward does after it (soft-caps, scales), found by running its
    forward on the given hidden states in place of its base model's."""

    def __init__(self, model, base_name, plain, output_class=None):
        super().__init__()
        self.output = model.get_output_embeddings()
        self.__dict__["model"] = model
        self.base_name, self.plain = base_name, plain
        self.output_class = output_class  # what the base model returns (its other fields are left None)

    @property
    def weight(self):
        return self.output.weight

    def forward(self, hidden):
        if self.plain:  # in the weights' dtype, as transformers' heads cast (Mamba keeps its residual in float32)
            return self.output(hidden.to(self.output.weight.dtype))
        if torch.compiler.is_compiling():  # dynamo replays the swap of the base's forward wrongly: run eager
            return self._eager_through_model(hidden)
        return self._through_model(hidden)

    def _through_model(self, hidden):
        """The model's forward on `hidden` in place of its base model's output."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        made = self.output_class if self.output_class is not None and hasattr(self.output_class,
                                                                               "last_hidden_state") else BaseModelOutputWithPast
        rows = hidden.dim() == 2  # (B, D): the last position of each row
        steps = hidden[:, None] if rows else hidden
        base = self.model.get_submodule(self.base_name)
        base.forward = lambda *a, **k: made(last_hidden_state=steps)
        try:
            ids = torch.zeros(steps.shape[:2], dtype=torch.long, device=hidden.device)
            logits = self.model(input_ids=ids, use_cache=False).logits
        finally:
            del base.forward
        return logits[:, 0] if rows else logits

    @torch.compiler.disable
    def _eager_through_model(self, hidden):
        return self._through_model(hidden)


class GenericBackbone(nn.Module):
    """token_ids (B, T) -> hidden (B, T, D): Prelude, `layers.N` (`DecoderLayer`), Tail.

    `stem` holds the base model's other children (embeddings, rotary tables, norms) so moves and
    casts reach them; the prelude and tail call them through the base model.
    """

    def __init__(self, prelude, layers, tail, stem):
        super().__init__()
        self.prelude, self.layers, self.tail, self.stem = prelude, nn.ModuleList(layers), tail, nn.ModuleDict(stem)
        self.rerun_reason = None  # why the cache pass did not fit, where the layers rerun (`rerun`)
        self.rerun_layers = []  # the indices of the decoder layers that rerun (all, or those the cache cannot serve)

    def forward(self, token_ids):
        x = self.prelude(token_ids)
        for layer in self.layers:
            x = layer(x)
        return self.tail(x)
