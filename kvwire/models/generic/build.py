"""Build the generic path's backbone and head from a transformers causal LM, by probing it once.

Nothing here is keyed by model type: the base model, its decoder layers, its attention modules,
what runs after the layers and how logits are made are all found by running the model's own
forward on a short probe and watching which modules it calls. The result is checked against the
model's own logits on that probe, so a model the split does not fit is refused, not run wrong.
"""
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ...layers.linear import Linear, WeightPack
from . import handed, held, owned, rerun, seam, state as state_slots, timeline
from .checks import check_chunks, check_decoding, close
from .arguments import takes, with_arguments
from .parts import (AttentionCall, DecoderLayer, GenericBackbone, Head, Prelude, ReplayTail, Tail, UncalledLayer,
                    recorded_calls)
from .sites import find_sites, install

PROBE_TOKENS = 12


def from_transformers(model):
    """(backbone, head, config) of the generic path for a transformers causal LM (weights shared).

    Decoder layers whose mixer keeps recurrent, convolution or linear-attention state in
    transformers' Cache API (Mamba, short convolutions, gated delta-nets) get a state slot
    (`kvwire.models.generic.state`), beside their keys and values where they also attend. Where
    their mixer's call of several tokens ignores the state it is handed (transformers' Mamba-1
    scan), chunks that continue a state go through it one token at a time
    (`kvwire.models.generic.stepping`). Layers computing attention themselves over what
    transformers' Cache API returns them (ALiBi, position biases by key column) keep their keys and
    values in a slot the cache's `update` fills (`kvwire.models.generic.timeline`).

    A layer keeping its state in its modules' attributes (RecurrentGemma), in a cache class of the
    model's own (MiniMax) or in an argument the model's forward hands it (RWKV, xLSTM) gets a state
    slot too (`kvwire.models.generic.held`, `owned`, `handed`); a factor the forward scales the
    hidden states by between two layers (RWKV's halving) is kept (`DecoderLayer.scale_in`).

    Where no cache fits (a layer whose attention transformers' interface never sees and that keeps
    no state any route finds, cached decoding or a prompt prefilled in two
    chunks that does not reproduce the model: `kvwire.models.generic.checks`), every decoder layer
    reruns over the inputs it keeps (`kvwire.models.generic.rerun`), with a warning and the reason
    in `backbone.rerun_reason`; where the only misfit is some layers reading one past length for the
    batch (Llama 4's NoPE layers), only those rerun (`backbone.rerun_layers`).

    Raises ValueError naming what does not fit: an encoder-decoder, bidirectional attention,
    logits that read later tokens, layers run more than once or on hidden states without an axis
    of the tokens, a forward the split does not reproduce, and a model the rerun does not
    reproduce either (the cache pass's reason).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; kvwire runs decoder-only language models")
    seam.register()
    _use_kvwire_attention(model)
    base_name, base, decoder = _base(model, config)
    layers_name, layers = _decoder_layers(base, config, name, decoder)
    probe = _probe_ids(config, model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            seen = _watch(model, base, layers_name, layers, probe)
    finally:
        model.train(was_training)
    parts = []
    for i, layer in enumerate(layers):
        if i in seen["uncalled"]:  # the forward skips it on text (Mllama's cross-attention layers)
            parts.append(UncalledLayer(layer, i))
            continue
        calls = seen["attention"][i]
        if not calls:  # a recurrent or state-space mixer, or nothing cached: the probe below decides
            parts.append(DecoderLayer(layer, i))
            continue
        for module, *_ in calls:
            if not getattr(module, "is_causal", True):
                raise ValueError(f"{name}: decoder layer {i}'s attention ({type(module).__name__}) is "
                                 f"bidirectional; kvwire runs causal language models")
        paths = {id(m): p for p, m in layer.named_modules()}
        parts.append(DecoderLayer(layer, i, [AttentionCall(paths[id(module)], *shape) for module, *shape in calls]))
    for before, part in zip(parts, parts[1:]):
        part.carried = seen["carried"].get(part.index, [])
        before.hands_on = bool(part.carried)
    for i, times in enumerate(seen["runs"]):
        if times > 1:  # a looped model: the split has one node per decoder layer, run once
            raise ValueError(f"{name}: its forward runs decoder layer {i} ({type(layers[i]).__name__}) {times} times "
                             f"(a looped or recurrent-depth model); the generic path runs each decoder layer once")
    tail_names = seen["tail"]
    stem = {n.replace(".", "_"): m for n, m in _around(base, layers_name) if n not in tail_names}
    backbone = GenericBackbone(Prelude(base, layers_name, seen["returns_tuple"], seen["uncalled"]), parts,
                               Tail([base.get_submodule(n) for n in tail_names]), stem)
    _find_scales(backbone, probe)
    try:
        _find_states(name, model, backbone, probe)
        refused = None
    except _Unfit as e:  # not a matter of caches: refused as it is
        raise ValueError(str(e)) from None
    except ValueError as e:  # no cache the pass can find: the layers may still rerun over their inputs
        refused = e
    with torch.no_grad():
        _check_causal(name, model, probe, seen["logits"])
    head = Head(model, base_name, plain=True, output_class=seen["output_class"])
    with torch.no_grad():
        try:
            try:
                hidden = backbone(probe)
            except TypeError:  # a final module taking more than the hidden states: the forward's own code after the layers
                if not tail_names:
                    raise
                backbone.tail = ReplayTail(base, layers_name, seen["returns_tuple"])
                hidden = backbone(probe)
        except Exception as e:  # noqa: BLE001 - a layer needing what another one computed in the model's forward
            if refused is not None:
                raise refused from None
            raise ValueError(f"{name}: its decoder layers do not run one after another on the arguments the model's "
                             f"forward gives them ({type(e).__name__}: {e}); its layers pass each other more than the "
                             f"hidden states, which the generic path does not carry") from e
        head, logits = _fit_head(model, base_name, seen, hidden)
        if not close(logits, seen["logits"]):  # more after the layers than modules one after another
            tail = backbone.tail
            if not isinstance(tail, ReplayTail):
                backbone.tail = ReplayTail(base, layers_name, seen["returns_tuple"])
            head, logits = _fit_head(model, base_name, seen, backbone(probe))
            if not close(logits, seen["logits"]):
                backbone.tail = tail
    if not close(logits, seen["logits"]):
        if refused is not None:
            raise refused
        diff = (logits - seen["logits"]).abs().max().item()
        raise ValueError(f"{name}: the generic path does not reproduce the model's own logits on a probe "
                         f"(max difference {diff:.3g}); its forward does more than prelude, decoder layers and "
                         f"final modules")
    if refused is None:
        try:
            _check_all_cached(name, model, backbone, head, probe, seen["logits"])
        except ValueError as e:
            refused = e
    if refused is not None:
        _rerun(name, backbone, head, probe, seen["logits"], refused)
    _find_sites(backbone, probe)
    _kvwire_linears(model)
    return backbone, head, config


def _find_scales(backbone, probe):
    """Set `scale_in` on each decoder layer whose input the model's forward makes by scaling the
    previous layer's output by one number (RWKV halves its hidden states every `rescale_every`
    layers in eval mode): seen on the probe, where the prelude's recorders hand each layer's input on
    as its output. Anything else between two layers is left to the build's logits check."""
    with torch.no_grad():
        try:
            backbone.prelude(probe)
        except Exception:  # noqa: BLE001 - a forward that does not run with its layers recorded: `_find_states` says why
            return
        calls = recorded_calls()
        for before, part in zip(backbone.layers, backbone.layers[1:]):
            if isinstance(before, UncalledLayer) or isinstance(part, UncalledLayer):
                continue
            a, b = calls[before.index][0], calls[part.index][0]
            if not (torch.is_tensor(a) and torch.is_tensor(b)) or a is b or a.shape != b.shape or torch.equal(a, b):
                continue
            a, b = a.double(), b.double()
            factor = float((a * b).sum() / (a * a).sum().clamp(min=1e-30))
            if torch.allclose(b, factor * a, rtol=1e-6, atol=1e-7 * float(a.abs().max())):
                part.scale_in = factor


def _check_causal(name, model, probe, expected):
    """Refuse a model whose logits at a token depend on later tokens (XLNet's default bidirectional
    attention): the probe with its second half changed must give the same logits before it. (Same
    length, not a shorter probe: a tiny model's routers and top-k choices turn float noise from
    other matrix shapes into other logits.)"""
    half = probe.shape[1] // 2
    other = torch.cat([probe[:, :half], probe[:, half:].roll(1, dims=0).roll(1, dims=1)], dim=1)  # probe ids only
    was_training = model.training
    model.eval()  # as the probe ran (dropout would look like reading later tokens)
    try:
        logits = model(input_ids=other, use_cache=False).logits
    finally:
        model.train(was_training)
    if not close(logits[:, :half], expected[:, :half]):
        raise ValueError(f"{name}: its logits at a token depend on later tokens (other tokens after the first {half} "
                         f"of a probe give other logits before them); kvwire runs causal language models")


def _check_all_cached(name, model, backbone, head, probe, expected):
    """The cached checks; where they fail on attention whose module does more with its keys than
    hand them to the interface (a mask or scale computed from the cache's length or contents), the
    checks again with those layers through the Cache API (`_find_hand`)."""
    try:
        _check_cached(name, backbone, head, probe, expected)
    except ValueError as e:
        if backbone.prelude.uses_timeline and not isinstance(e, _PastLength):
            _check_finished_mask(name, backbone, head, probe, expected, e)
            return
        if backbone.prelude.uses_timeline or any(part.states is not None for part in backbone.layers):
            raise
        calls = [part.calls for part in backbone.layers]
        readers = set()
        try:
            readers = _find_hand(name, model, backbone, probe, {p.index: str(e) for p in backbone.layers if p.calls},
                                 _cache_layer_count(model, backbone))
            _check_cached(name, backbone, head, probe, expected)
        except ValueError as again:
            if isinstance(again, _PastLength) and _rerun_some(name, backbone, head, probe, expected, readers, again):
                return
            for part, kept in zip(backbone.layers, calls):
                part.calls = kept
            backbone.prelude.uses_timeline = False
            raise (ValueError(str(again)) if isinstance(again, _PastLength) else e) from None


def _rerun_some(name, backbone, head, probe, expected, layers, why):
    """Make only decoder layers `layers` (those asking transformers' cache for its past length: one
    number for the batch, `why`) rerun over their kept inputs, the others keeping the caches the
    timeline gives them; checked as any cache is. False, everything as it was, where that does not
    reproduce the model, where every layer would rerun or where layers hand each other tensors."""
    prelude = backbone.prelude
    parts = [part for part in backbone.layers if part.index in layers]
    if not parts or len(parts) == len(backbone.layers) or any(part.carried for part in backbone.layers) \
            or head.weight.shape[0] > rerun.IDS_LIMIT:
        return False
    with torch.no_grad():
        shape = tuple(prelude(probe).shape[2:])
    prelude.reruns = prelude.partly = True
    for part in parts:
        part.rerun_shape = shape  # its attention calls stay: they name its sites
    try:
        _check_cached(name, backbone, head, probe, expected)
    except ValueError:
        prelude.reruns = prelude.partly = False
        for part in parts:
            part.rerun_shape = None
        return False
    backbone.rerun_layers = [part.index for part in parts]
    backbone.rerun_reason = f"{why}; decoder layers {backbone.rerun_layers} rerun over their kept inputs, the " \
                            f"others keep their caches"
    warnings.warn(f"{name}: decoder layers {backbone.rerun_layers} of {len(backbone.layers)} compute with one past "
                  f"length for the batch, which kvwire's per-row cache cannot give them; they rerun over their "
                  f"kept inputs (exact, but each step runs them over the whole history), the others keep their "
                  f"caches", stacklevel=4)
    return True


def _check_finished_mask(name, backbone, head, probe, expected, failed):
    """The cached checks again with the timeline's mask handed to the forward finished (4D), for a
    forward that does more with a 2D padding mask than mask by it (GIT widens it by an image's
    tokens once the cache holds some); else `failed` raised, the 2D mask kept."""
    backbone.prelude.finished_mask = True
    try:
        _check_cached(name, backbone, head, probe, expected)
    except ValueError:
        backbone.prelude.finished_mask = False
        raise failed from None


def _rerun(name, backbone, head, probe, expected, refused):
    """Make every decoder layer rerun over its kept inputs (`kvwire.models.generic.rerun`), the
    cache pass having `refused` the model; checked as any cache is. Raises `refused` where the
    rerun does not reproduce the model either (a model whose layers are not causal, say)."""
    prelude = backbone.prelude
    with torch.no_grad():
        shape = tuple(prelude(probe).shape[2:])
    if head.weight.shape[0] > rerun.IDS_LIMIT:  # ids are kept in the float32 cache
        raise refused
    prelude.uses_timeline, prelude.finished_mask, prelude.reruns = False, False, True
    for part in backbone.layers:
        if not isinstance(part, UncalledLayer):
            part.states, part.rerun_shape = None, shape  # its attention calls stay: they name its sites
            part.__dict__["mixer"] = None
    try:
        _check_cached(name, backbone, head, probe, expected)
    except ValueError:
        raise refused from None
    backbone.rerun_reason = str(refused)
    backbone.rerun_layers = [part.index for part in backbone.layers if part.rerun_shape is not None]
    warnings.warn(f"{name}: kvwire's cache pass does not fit this model ({refused}); its decoder layers rerun over "
                  f"their kept inputs instead: exact, but each step runs every layer over the whole history",
                  stacklevel=3)


def _fit_head(model, base_name, seen, hidden):
    """(head, its logits of `hidden`): the output embedding alone where that gives the model's own
    logits on the probe, else the model's forward after its base model (soft-caps, scales)."""
    head = Head(model, base_name, plain=True, output_class=seen["output_class"])
    if not close(head(hidden), seen["logits"]):
        head = Head(model, base_name, plain=False, output_class=seen["output_class"])
    return head, head(hidden)


class _Unfit(ValueError):
    """A model the split into prelude, layers and tail does not hold, whatever caches it."""


class _PastLength(ValueError):
    """A model right through the Cache API but for the past length it reads there (`_check_cached`)."""


def _check_cached(name, backbone, head, probe, expected):
    """The build's cached checks (`kvwire.models.generic.checks`), a layer that cannot run on a cache
    slot at all refused as they refuse one that runs wrong (ValueError)."""
    try:
        check_decoding(name, backbone, head, probe, expected)
        check_chunks(name, backbone, head, probe, expected)
        if backbone.prelude.uses_timeline:
            try:
                with timeline.shifted(1 << 20):
                    check_decoding(name, backbone, head, probe, expected)
            except ValueError:
                raise _PastLength(f"{name}: its layers compute with the number of past tokens transformers' cache "
                                 f"reports (one number for the batch), which cannot say where each of kvwire's "
                                 f"rows stands") from None
    except (RuntimeError, IndexError, TypeError) as e:
        raise ValueError(f"{name}: cached decoding fails ({type(e).__name__}: {e}); its layers depend on more than "
                         f"their keys and values, which the generic path does not carry yet") from e


def _cache_layer_count(model, backbone):
    """How many layers a transformers cache of the model holds: indexed by the mixers' own
    layer_idx, which need not be the decoder layer's."""
    return max([len(backbone.layers)] + [m.layer_idx + 1 for m in model.modules()
                                         if isinstance(getattr(m, "layer_idx", None), int)])


def _find_states(name, model, backbone, probe):
    """Give each decoder layer without an attention call the states its mixer keeps in transformers'
    Cache API (`kvwire.models.generic.state`), found by running every layer once on its recorded
    probe call with transformers' own lazily initialised cache layers; for a layer failing there,
    the state it keeps in a cache class of the model's own (`_find_owned`); for one taking no cache,
    the state its model's forward hands it (`_find_handed`); for one taking `use_cache` and leaving
    nothing in the cache, state in its modules' attributes (`_find_held`). Refused: a layer without
    attention where none of these finds a state, that writes keys/values to the cache itself and
    does not attend over what the Cache API returns it (`_find_hand`), and a layer keeping both
    keys/values and state whose mixer is not one of its modules taking an `attention_mask` (the
    padding mask that keeps left pads out of the state). A layer that keeps nothing stays uncached."""
    count = _cache_layer_count(model, backbone)
    with torch.no_grad():
        try:
            shape = tuple(backbone.prelude(probe).shape)
        except Exception as e:  # noqa: BLE001 - a forward that does not run with its layers recorded
            bare = next((part for part in backbone.layers if part.attention is None), None)
            if bare is None:
                raise
            raise ValueError(f"{name}: decoder layer {bare.index} ({type(bare.block).__name__}) has no attention that "
                             f"transformers' attention interface sees, and the model's forward does not run with its "
                             f"decoder layers recorded ({type(e).__name__}: {e}); the generic path caches attention "
                             f"and the state of layers that keep it in transformers' Cache API") from e
        if probe.shape[1] not in shape[:-1]:  # CPM-Ant's learned prompt, prepended inside its forward
            raise _Unfit(f"{name}: its decoder layers take hidden states of shape {shape} for {probe.shape[0]} rows "
                         f"of {probe.shape[1]} tokens (positions of its own added to the tokens); the generic path "
                         f"caches one position per token")
        calls = recorded_calls()
        refused = {}  # index -> why, for layers that may still attend through the Cache API (`_find_hand`)
        own = None  # (the model's own cache class or None, why none), looked for once a layer needs it
        bare = {}  # index -> (part, why): layers without attention taking no cache (`_find_handed`)
        for part in backbone.layers:
            if isinstance(part, UncalledLayer):
                continue
            hidden, args, kwargs = calls[part.index]
            layer = type(part.block).__name__
            plain = f"{name}: decoder layer {part.index} ({layer}) has no attention that transformers' attention " \
                    f"interface sees"
            if not takes(part.block, "cache", kwargs):
                if part.attention is None:
                    bare[part.index] = (part, f"{plain} and takes no `cache` argument; the generic path caches "
                                              f"attention and the state of layers that keep it in transformers' "
                                              f"Cache API or that their model's forward hands them")
                continue
            cache = state_slots.probe_cache(count)
            args_, kwargs_ = with_arguments(part.block, args, kwargs, {"cache": cache})
            mixer = []  # the first of the layer's modules whose call left state: its token mixer
            hooks = [child.register_forward_hook(
                lambda m, a, o: mixer.append(m) if not mixer and state_slots.found_states(cache) else None)
                for child in part.block.children()]
            failed = None  # why the layer cannot run on transformers' plain cache
            try:
                part.block(hidden, *args_, **kwargs_)
            except Exception as e:  # noqa: BLE001 - a layer that cannot run on a cache at all
                failed = f"{plain}, and running it on a transformers cache fails ({type(e).__name__}: {e})"
            finally:
                for h in hooks:
                    h.remove()
            if failed is not None:
                if part.attention is not None:
                    continue  # its attention is cached through the interface, as without this probe
                if own is None:  # the model's own cache class, looked for once
                    own = owned.own_class(backbone.prelude.base, probe, backbone.prelude.cache_name)
                _find_owned(part, own, model.config, hidden, args, kwargs, probe.shape[0], failed)
                continue
            states = state_slots.found_states(cache)
            if states:
                states = state_slots.with_followers(part.block, states, _left_states(hidden, args, kwargs, count))
            if part.attention is not None:
                if states:
                    _both(name, part, layer, states, mixer[0] if mixer else None, count)
                continue
            if state_slots.wrote_keys(cache):
                refused[part.index] = f"{plain} and computes attention itself (its keys and values go to the " \
                                      f"cache directly), but not over what the cache returns it; the generic " \
                                      f"path caches attention that the interface sees, attention over transformers' " \
                                      f"Cache API and recurrent, convolution and linear-attention state"
                if states:  # keys and state both, the keys written by the layer itself
                    raise ValueError(refused[part.index])
                continue
            if states:
                part.states = state_slots.StateCache(states, count)
                part.__dict__["mixer"] = mixer[0] if mixer else None  # not a submodule: block holds it
            elif takes(part.block, "use_cache", kwargs):
                _find_held(part, hidden, args, kwargs, probe.shape[0])
            # else a layer with nothing to cache (a feed-forward block): the cached check below has the last word
        if bare:
            _find_handed(backbone, probe, bare, calls, refused)
    if refused:
        _find_hand(name, model, backbone, probe, refused, count)


def _find_handed(backbone, probe, bare, calls, refused):
    """Give the decoder layers `bare` ({index: (part, why)}: no attention, no cache argument) the
    state their model's forward hands them as an argument (`kvwire.models.generic.handed`), found by
    one run of it with use_cache=True; a layer with none joins `refused` with why."""
    found = handed.find(backbone.prelude.base, probe, {i: part.block for i, (part, _) in bare.items()}, calls)
    for i, (part, why) in bare.items():
        if isinstance(found[i], str):
            refused[i] = f"{why} ({found[i]})"
        else:
            part.states = found[i]


def _find_hand(name, model, backbone, probe, refused, count):
    """Find, among the decoder layers `refused` ({index: why}), those whose attention is computed
    by one of their modules over what transformers' Cache API returns it (Bloom, MPT, GPT-Neo):
    the model's forward runs once with a cache, and a layer that hands exactly one key/value pair
    to `update`, nothing else, gets an attention call `through_cache` (its keys and values in a
    cache slot, `kvwire.models.generic.timeline`). Any other refused layer raises its reason.
    Returns the refused layers that ask the cache for its past length (`_rerun_some`)."""
    prelude = backbone.prelude
    base = prelude.base
    owner, stack, seen = {}, [], {i: [] for i in refused}
    hooks = []
    for part in backbone.layers:
        if part.index in refused:
            for path, module in part.block.named_modules():
                owner[id(module)] = (part.index, path)
                hooks.append(module.register_forward_pre_hook(lambda m, a: stack.append(m)))
                hooks.append(module.register_forward_hook(lambda m, a, o: None if stack.pop() else None))
    cache = state_slots.probe_cache(count)
    update, update_indexer = cache.update, cache.update_indexer
    indexers = {i: [] for i in refused}  # layer -> the key sizes of its indexer's `update_indexer` calls

    def watched(key, value, layer_idx, *args, **kwargs):
        where = owner.get(id(stack[-1])) if stack else None
        if where is not None:
            seen[where[0]].append((where[1], key.shape, value.shape))
        return update(key, value, layer_idx, *args, **kwargs)

    def watched_indexer(key, layer_idx, *args, **kwargs):
        where = owner.get(id(stack[-1])) if stack else None
        if where is not None:
            indexers[where[0]].append(key.shape[-1])
        return update_indexer(key, layer_idx, *args, **kwargs)

    seq_length, readers = cache.get_seq_length, set()

    def watched_length(*args, **kwargs):
        where = owner.get(id(stack[-1])) if stack else None
        if where is not None:  # a layer asking for the past length (not the forward's mask code)
            readers.add(where[0])
        return seq_length(*args, **kwargs)

    cache.update, cache.update_indexer, cache.get_seq_length = watched, watched_indexer, watched_length
    positions = torch.arange(probe.shape[1], device=probe.device)[None].expand(probe.shape[0], -1)
    try:
        with torch.no_grad():
            base(input_ids=probe, position_ids=positions, use_cache=True, **{prelude.cache_name: cache})
    except Exception:  # noqa: BLE001 - a forward that does not run with a cache: the reasons stand
        seen = {i: [] for i in refused}
    finally:
        for h in hooks:
            h.remove()
    for part in backbone.layers:
        if part.index not in refused:
            continue
        updates = seen[part.index]
        if len(updates) != 1:
            raise ValueError(refused[part.index])
        path, key, value = updates[0]
        if len(indexers[part.index]) > 1:
            raise ValueError(refused[part.index])
        part.calls = [AttentionCall(path, key[1], key[-1], value[-1], through_cache=True,
                                    indexer_size=indexers[part.index][0] if indexers[part.index] else None)]
    prelude.uses_timeline, prelude.cache_layers = True, count
    return readers


def _in_dtype(hidden, args, kwargs):
    """call(twin, given, dtype): a copy `twin` of a decoder layer in `dtype` called as the probe
    recorded the layer's call (floating tensors in `dtype`), the arguments `given` ({name: value}) in
    place."""
    def cast(tree, dtype):
        return tree_map(lambda v: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v, tree)

    def call(twin, given, dtype):
        args_, kwargs_ = with_arguments(twin, args, kwargs, given)
        return twin(*cast((hidden, *args_), dtype), **cast(kwargs_, dtype))
    return call


def _left_states(hidden, args, kwargs, count):
    """left(twin, dtype): {key: dtype} of the Cache-API states a call of the layer copy `twin` (in
    `dtype`) leaves in a fresh probe cache (`kvwire.models.generic.state.with_followers`)."""
    other = _in_dtype(hidden, args, kwargs)

    def left(twin, dtype):
        cache = state_slots.probe_cache(count)
        other(twin, {"cache": cache}, dtype)
        return {s.key: s.dtype for s in state_slots.found_states(cache)}
    return left


def _find_held(part, hidden, args, kwargs, batch_size):
    """Give a decoder layer whose mixer keeps its state in attributes of its modules, outside the
    Cache API (RecurrentGemma's RG-LRU and convolution), a state slot for them
    (`kvwire.models.generic.held`), found by its probe call with `use_cache=True`."""
    args, kwargs = with_arguments(part.block, args, kwargs, {"use_cache": True})
    try:
        found = held.find(part.block, lambda: part.block(hidden, *args, **kwargs), batch_size)
    except Exception:  # noqa: BLE001 - a layer that does not run with use_cache: nothing found, the checks decide
        return
    if found:
        other = _in_dtype(hidden, args, kwargs)

        def left(twin, dtype):
            found_there = held.find(twin, lambda: other(twin, {"use_cache": True}, dtype), batch_size)
            return {h.key: h.dtype for h in found_there}

        found = state_slots.with_followers(part.block, found, left)
        part.states = held.HeldStates(found, held.mixer_path(found))
        held.install(part.block.get_submodule(part.states.mixer))


def _find_owned(part, own, config, hidden, args, kwargs, batch_size, why):
    """Give a decoder layer whose mixer keeps its state in the model's own cache class (MiniMax's
    linear caches) a state slot for it (`kvwire.models.generic.owned`), found by its probe call
    handed a fresh object of the class (`own`: (the class or None, why none), from
    `owned.own_class`). Raises ValueError with `why` (the layer failing on transformers' plain
    cache) where the model has no such class or the layer leaves nothing in it."""
    reason = f"{why}; the generic path caches attention and the state of layers that keep it in transformers' " \
             f"Cache API or in a cache class of the model's own"
    cls, none = own
    if cls is None:
        raise ValueError(f"{reason} ({none})")
    try:
        make = owned.maker(cls, config)
    except Exception as e:  # noqa: BLE001 - a class this path cannot make an object of
        raise ValueError(f"{reason} ({cls.__name__}() and {cls.__name__}(config=...) fail: {type(e).__name__}: "
                         f"{e})") from e
    handed = []  # the layer's modules handed the cache: the first is its mixer
    # as the model's forward calls it to cache (a mixer may write its state only then)
    caching = {"use_cache": True} if takes(part.block, "use_cache", kwargs) else {}

    def saw(module, args_, kwargs_, cache):
        if not handed and any(v is cache for v in (*args_, *kwargs_.values())):
            handed.append(module)

    def call(cache):
        hooks = [child.register_forward_pre_hook(lambda m, a, k: saw(m, a, k, cache), with_kwargs=True)
                 for child in part.block.children()]
        try:
            args_, kwargs_ = with_arguments(part.block, args, kwargs, {"cache": cache, **caching})
            part.block(hidden, *args_, **kwargs_)
        finally:
            for h in hooks:
                h.remove()

    try:
        found, layouts = owned.find(make, call, batch_size)
    except Exception as e:  # noqa: BLE001 - a layer that fails on the model's own cache too
        raise ValueError(f"{reason} (on {cls.__name__}: {type(e).__name__}: {e})") from e
    if not found:
        raise ValueError(f"{reason} (it leaves no state in {cls.__name__})")
    other = _in_dtype(hidden, args, kwargs)

    def left(twin, dtype):
        found_there, _ = owned.find(make, lambda cache: other(twin, {"cache": cache, **caching}, dtype), batch_size)
        return {s.key: s.dtype for s in found_there}

    found = state_slots.with_followers(part.block, found, left)
    part.states = owned.OwnedStates(found, layouts, make, use_cache=bool(caching))
    part.__dict__["mixer"] = handed[0] if handed else None  # not a submodule: block holds it


def _both(name, part, layer, states, mixer, count):
    """Give a decoder layer that keeps attention keys/values and state both slots, its mixer the
    padding-mask hook (`kvwire.models.generic.state`)."""
    if mixer is None or not state_slots.mixer_takes_mask(mixer):
        what = "is not one of its modules" if mixer is None else \
            f"({type(mixer).__name__}) takes no `attention_mask`"
        raise ValueError(f"{name}: decoder layer {part.index} ({layer}) keeps attention keys/values and recurrent "
                         f"state ({', '.join(sorted({s.kind for s in states}))}), but the mixer keeping the state "
                         f"{what}; the generic path gives a hybrid layer's mixer its padding mask through its "
                         f"`attention_mask`")
    part.states = state_slots.StateCache(states, count)
    part.__dict__["mixer"] = mixer  # not a submodule: block holds it
    state_slots.install_padding(mixer)


def _find_sites(backbone, probe):
    """Find each decoder layer's inner sites on the probe (`kvwire.models.generic.sites`) and hook
    their modules."""
    with torch.no_grad():
        x = backbone.prelude(probe)
        calls = recorded_calls()
        for part in backbone.layers:
            if isinstance(part, UncalledLayer):
                continue
            args, kwargs = part.arguments(calls)
            mixer = part.attention if part.attention is not None else part.mixer
            points, heads_width = find_sites(part.block, mixer, x, args, kwargs,
                                             with_heads=part.attention is not None)
            install(points)
            part.found_sites(points, x.shape[-1], heads_width)
            x = part(x)


def _kvwire_linears(model):
    """Every plain `nn.Linear` of the model computes with kvwire's kernels from now on (its class
    becomes `kvwire.layers.linear.Linear`, the same parameters): packed weights and kvwire's GEMV for
    one-row decode steps, where most of a step's time goes. Results agree to float32 rounding."""
    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear
            module.pack = WeightPack(role="head" if module is head else "projection")


def _use_kvwire_attention(model):
    try:
        model.set_attn_implementation(seam.NAME)
    except (ValueError, AttributeError, TypeError):
        for sub in model.modules():
            cfg = getattr(sub, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = seam.NAME


def _base(model, config):
    """(dotted path, module, whether it is the model's own `get_decoder()`) of the base model inside
    a causal LM: the module holding its list of num_hidden_layers decoder layers (`get_decoder()`
    where that is it, and there also the one list of layers it holds where num_hidden_layers counts
    sublayers: LongCat-Flash's two per layer)."""
    n = getattr(config, "num_hidden_layers", None)
    getter = getattr(model, "get_decoder", None)
    decoder = getter() if callable(getter) else None
    candidates = [decoder] if decoder is not None else []
    candidates += [m for _, m in model.named_modules()
                   if any(isinstance(c, nn.ModuleList) and len(c) == n for c in m.children())]
    for base in candidates:
        path = next((p for p, m in model.named_modules() if m is base and p), None)
        if path is not None and _layer_lists(base, n, base is decoder):
            return path, base, base is decoder
    lists = [f"{p} ({len(m)})" for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    said = "its config names no number of decoder layers (num_hidden_layers)" if n is None else \
        f"no module holds a list of its {n} decoder layers (num_hidden_layers)"
    raise ValueError(f"{type(model).__name__}: cannot find its base model: {said}; its module lists are "
                     f"{', '.join(lists[:6]) or 'none'}. The generic path runs one list of decoder layers, each "
                     f"once per token (not stacks run in cycles or over patches)")


def _layer_lists(base, n, decoder):
    """[(path, ModuleList)] in `base` that may be its decoder layers: its children of n layers,
    else (for the model's own `get_decoder()`) its only list, else the lists of n layers nearest
    below it (a child running the layers: GIT's `encoder.layer`, beside its image encoder's deeper
    list)."""
    lists = [(k, v) for k, v in base.named_children() if isinstance(v, nn.ModuleList)]
    sized = [(k, v) for k, v in lists if len(v) == n]
    if sized or not decoder:
        return sized
    if len(lists) == 1:
        return lists
    nested = [(k, v) for k, v in base.named_modules() if k and isinstance(v, nn.ModuleList) and len(v) == n]
    depth = min((k.count(".") for k, _ in nested), default=None)
    return [(k, v) for k, v in nested if k.count(".") == depth]


def _decoder_layers(base, config, name, decoder):
    n = getattr(config, "num_hidden_layers", None)
    lists = _layer_lists(base, n, decoder)
    if len(lists) != 1:
        raise ValueError(f"{name}: expected one list of {n} decoder layers (num_hidden_layers) in "
                         f"{type(base).__name__}; found {[k for k, _ in lists] or 'none'}")
    return lists[0]


def _probe_ids(config, model):
    """(2, PROBE_TOKENS) random token ids, none of the ids the model's configs name as special
    (image, audio, video placeholders: a multimodal forward swaps their embeddings for what it
    encodes, which a text prompt does not carry)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    special = _special_ids(model.config) | _special_ids(config)
    allowed = torch.tensor([i for i in range(min(3, vocab - 1), vocab) if i not in special] or [vocab - 1])
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    return allowed[torch.randint(len(allowed), (2, PROBE_TOKENS), generator=g)].to(device)


def _special_ids(config, depth=0):
    """The ids a config (and its sub-configs) names in its *_token_id / *_token_index fields, but
    for padding, beginning and end of text."""
    from transformers import PretrainedConfig

    found = set()
    for name, value in vars(config).items():
        if name.endswith(("_token_id", "_token_index")) and name not in ("pad_token_id", "bos_token_id",
                                                                            "eos_token_id"):
            found.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
        elif depth < 2 and isinstance(value, PretrainedConfig):  # a sub-config (text, vision, audio)
            found |= _special_ids(value, depth + 1)
    return found


def _watch(model, base, layers_name, layers, probe):
    """Run the model on the probe, recording: its logits, the order of the base model's children
    (and of the children beside the layers of those holding them), each decoder layer's attention
    calls and whether the layers return tuples."""
    order, owner, attention = [], {}, [[] for _ in layers]
    for i, layer in enumerate(layers):
        for m in layer.modules():
            owner.setdefault(id(m), i)
    marker = layers_name
    hooks = [child.register_forward_hook(lambda m, a, o, n=n: order.append(n))
             for n, child in _around(base, layers_name)]
    runs = [[] for _ in layers]  # per layer, each call's [arguments after the hidden states, kwargs, output]

    def entered(i):
        return lambda module, args, kwargs: runs[i].append([args[1:], kwargs, None]) and None

    def left(i):
        def hook(module, args, out):
            order.append(marker)
            runs[i][-1][2] = out
        return hook

    for i, layer in enumerate(layers):
        hooks += [layer.register_forward_pre_hook(entered(i), with_kwargs=True), layer.register_forward_hook(left(i))]
    outputs = []
    hooks.append(base.register_forward_hook(lambda m, a, o: outputs.append(type(o))))

    def seen(module, key, value, window, plain_math):
        i = owner.get(id(module))
        if i is not None and _across_depth(module, key, probe.shape[1]):
            return  # within each position (over earlier layers' outputs): no tokens mixed, nothing to cache
        if i is not None:
            attention[i].append((module, key.shape[1], key.shape[-1], value.shape[-1], window, plain_math))

    try:
        with seam.watching(seen):
            logits = model(input_ids=probe, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    layers_at = [k for k, n in enumerate(order) if n == marker]
    tail = [n for n in order[layers_at[-1] + 1:]] if layers_at else []
    first = next((r[0][2] for r in runs if r), None)
    return {"logits": logits.float(), "attention": attention, "tail": list(dict.fromkeys(tail)),
            "returns_tuple": len(first) if isinstance(first, (tuple, list)) else 0,
            "output_class": outputs[0] if outputs else None,
            "uncalled": [i for i, r in enumerate(runs) if not r], "carried": _carried(runs),
            "runs": [len(r) for r in runs]}


def _carried(runs):
    """{layer: [(k, argument)]}: where the previous layer's k-th returned tensor (k >= 1) is this
    layer's argument (a position after the hidden states, or a keyword) as it is, on the probe."""
    carried = {}
    for i in range(1, len(runs)):
        if not runs[i] or not runs[i - 1] or not isinstance(runs[i - 1][0][2], (tuple, list)):
            continue
        args, kwargs, _ = runs[i][0]
        links = [(k, at) for k, t in enumerate(runs[i - 1][0][2]) if k and isinstance(t, torch.Tensor)
                 for at, v in [*enumerate(args), *kwargs.items()] if v is t]
        if links:
            carried[i] = links
    return carried


def _around(base, layers_name):
    """[(path, module)]: the base model's children but the decoder layers, and where a child holds
    them (a dotted `layers_name`), that child's other children in its place, and so on down."""
    first, _, rest = layers_name.partition(".")
    around = []
    for n, child in base.named_children():
        if n != first:
            around.append((n, child))
        elif rest:
            around += [(f"{n}.{k}", m) for k, m in _around(child, rest)]
    return around


def _across_depth(module, key, T):
    """Whether an attention call mixes no tokens: a non-causal call whose keys hold the probe's T
    positions where heads go and something else (the outputs of earlier layers at each position,
    Inkling 2's block attention residuals) along their sequence axis. It runs within each token,
    uncached, as a feed-forward module does."""
    return (not getattr(module, "is_causal", True) and key.dim() == 4 and key.shape[1] == T
            and key.shape[2] != T)
