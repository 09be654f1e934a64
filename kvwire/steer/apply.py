"""`lm.steer`, `lm.ablate`, `lm.clamp`: steering layers edited into a model's graph after a named
site of the blocks they name (registered as `CausalLM`'s implementation of those methods)."""
import torch

from ..graph import insert_after, numbered_blocks
from ..graph.sites import put_inside, site_targets
from ..graph.edit import summarize_indices
from .fingerprint import check_fingerprint
from .gate import Gate, GatedInsert, Probe
from .layer import Steer
from .ops import Ablate, Clamp
from .schedule import Scheduled
from .vector import ControlVector, parse_layers


def add_vector(lm, vector, strength=None, *, site=None, when=None, generated_only=False, name=None,
               allow_mismatch=False, gate=None):
    """The same model with `vector` added at `site` of its blocks; see `CausalLM.steer`.

    strength None: the vector's recommended strength (`vector.strength`), else 1.

    site None: the vector's own (`vector.site`). A vector made for another operation is refused, as
    is one whose recorded model fingerprint differs from `lm`'s, unless `allow_mismatch`
    (a deliberate transfer, e.g. base to instruct; the width must fit all the same)."""
    if not isinstance(vector, ControlVector):
        raise TypeError(f"steer expects a kw.ControlVector, got {type(vector).__name__}")
    if vector.operation != "add":
        raise ValueError(f"this control vector is made to {vector.operation}, not to add: use "
                         f"lm.{vector.operation}(vector) instead of lm.steer")
    check_fingerprint(vector.fingerprint, lm, allow_mismatch)
    strength = _recommended(vector) if strength is None else strength
    return insert_at_site(lm, vector.directions, vector.site if site is None else site, name, "steer",
                          lambda d, n, dev: Steer(d, strength, generated_only, n, device=dev, when=when), gate)


def ablate(lm, directions, *, layers=None, site=None, strength=None, when=None, name=None, allow_mismatch=False,
           gate=None):
    """The same model with `directions` projected out at `site`; see `CausalLM.ablate`.

    site None: a ControlVector's own site, else "block_out". A ControlVector's fingerprint is
    checked as in `add_vector`; its operation is not (any direction can be projected out).
    strength None: a ControlVector's recommended strength, else 1 (the whole component)."""
    strength = _recommended(directions) if strength is None else strength
    return insert_at_site(lm, _per_block(lm, directions, layers, allow_mismatch), _site(directions, site), name,
                          "ablate", lambda d, n, dev: Ablate(d, strength, n, device=dev, when=when), gate)


def clamp(lm, directions, lo=None, hi=None, *, layers=None, site=None, when=None, name=None, allow_mismatch=False,
          gate=None):
    """The same model with the projection on `directions` held in [lo, hi]; see `CausalLM.clamp`.

    site and allow_mismatch: as `ablate`. No bounds and a ControlVector with a recommended strength:
    the projection held at that strength (lo = hi = `directions.strength`)."""
    if lo is None and hi is None and isinstance(directions, ControlVector) and directions.strength is not None:
        lo = hi = directions.strength
    return insert_at_site(lm, _per_block(lm, directions, layers, allow_mismatch), _site(directions, site), name,
                          "clamp", lambda d, n, dev: Clamp(d, lo, hi, n, device=dev, when=when), gate)


def _recommended(directions):
    """A ControlVector's recommended strength, else 1."""
    chosen = directions.strength if isinstance(directions, ControlVector) else None
    return 1.0 if chosen is None else chosen


def _site(directions, site):
    if site is not None:
        return site
    return directions.site if isinstance(directions, ControlVector) else "block_out"


def _per_block(lm, directions, layers, allow_mismatch=False):
    """{block index: (D,) or (K, D) tensor} from a ControlVector (its fingerprint checked), a
    {block: tensor} dict or one tensor used at every block `layers` picks (None: every block; a
    ControlVector's own blocks)."""
    blocks = numbered_blocks(lm.backbone)
    if isinstance(directions, ControlVector):
        check_fingerprint(directions.fingerprint, lm, allow_mismatch)
        directions = directions.directions
    if isinstance(directions, dict):
        picked = list(directions) if layers is None else parse_layers(layers, blocks)
        missing = [i for i in picked if i not in directions]
        if missing:
            raise ValueError(f"no direction given for blocks {missing}; the directions are for blocks "
                             f"{summarize_indices(directions)}")
        return {i: directions[i] for i in picked}
    if not isinstance(directions, (torch.Tensor, list, tuple)):
        raise TypeError(f"directions must be a kw.ControlVector, a {{block: tensor}} dict or a (D,) or (K, D) "
                        f"tensor; got {type(directions).__name__}")
    picked = sorted(blocks) if layers is None else parse_layers(layers, blocks)
    return {i: directions for i in picked}


def insert_at_site(lm, per_block, site, name, stem, make, gate=None):
    """`lm.edit` putting `make(direction, name, device)` after `site` of each block in `per_block`
    ({block: direction}), after the steering already there; shared by every steering operation.

    name None: `stem`, or `stem2`, `stem3`, ... when taken; a taken name must come with the same
    defaults (layers sharing a name share their runtime inputs). gate: a `Gate` whose probe
    opens and shuts the new layers (see `kvwire.steer.gate`)."""
    what = {"steer": "control vector", "sae": "the SAE"}.get(stem, "directions")
    blocks = numbered_blocks(lm.backbone)
    bad = [i for i in per_block if i not in blocks]
    if bad:
        raise ValueError(f"{what} steers blocks {bad}, but this model has blocks "
                         f"{summarize_indices(blocks) or 'none'}")
    depth, calls = site_targets(lm.backbone, site, list(per_block), "layer" if gate is not None else None)
    for i, d in per_block.items():
        width = lm.backbone.get_submodule(calls[i][0]).site_width(site) if depth == "inner" else lm.head.weight.shape[1]
        got = (d if isinstance(d, torch.Tensor) else torch.as_tensor(d)).shape[-1]
        if got != width:
            size = "hidden size" if depth != "inner" or site != "attn_heads" else "heads' width (heads x head size)"
            raise ValueError(f"{what} width {got} does not fit this model's {size} {width} at site {site!r}")
    taken = {m.name: m for m in lm.backbone.modules() if isinstance(m, Scheduled)}
    if name is None:
        name = next(n for n in (stem, *(f"{stem}{k}" for k in range(2, len(taken) + 3))) if n not in taken)
    device = lm.device  # the directions (kept on the CPU) and the runtime defaults move to the weights
    first = make(per_block[next(iter(per_block))], name, device)
    if name in taken and not taken[name].same_inputs(first):
        raise ValueError(f"this model already has runtime inputs named {name!r} ({taken[name].extra_repr()}); "
                         f"layers sharing a name share their inputs: pick another name")
    index = {call: i for i, ends in calls.items() for call in ends}
    if depth == "inner":  # inside one-call layers: copies of them hold the operations (and read the gate)
        inside = {call: make(per_block[i], name, device) for call, i in index.items()}
        if gate is None:
            edited = lm.edit(None, depth="block" if set(index) <= set(blocks.values()) else "layer")
            put_inside(edited.backbone, site, inside)
            return edited
        probing = _gated(lm, gate, {})  # the probe alone; the gate goes to the edited calls
        edited = lm.edit(probing, depth="layer")
        probe_call = next(n for n, m in edited.backbone.named_modules() if m is probing.probe)
        put_inside(edited.backbone, site, inside, probe_call)
        return edited
    if gate is None:
        return lm.edit(insert_after(list(index), lambda call, layer: make(per_block[index[call]], name, device)),
                       depth=depth)
    return lm.edit(_gated(lm, gate, {call: make(per_block[i], name, device) for call, i in index.items()}),
                   depth="layer")


def _gated(lm, gate, targets):
    """The clone fn reading `gate`'s probe at its site and gating `targets` ({call: layer}) with it."""
    if not isinstance(gate, Gate):
        raise TypeError(f"gate must be a kw.Gate, got {type(gate).__name__}")
    probes = {m.name: m for m in lm.backbone.modules() if isinstance(m, Probe)}
    probe = gate.probe(lm.device)
    if gate.name in probes and not torch.equal(probes[gate.name].threshold.cpu(), probe.threshold.cpu()):
        raise ValueError(f"this model already has a gate named {gate.name!r} with threshold "
                         f"{probes[gate.name].threshold.tolist()}; gates sharing a name share their threshold "
                         f"input: give Gate(name=...) another name")
    _, calls = site_targets(lm.backbone, gate.site, [gate.layer], "layer")
    return GatedInsert(calls[gate.layer][0], probe, targets)  # a block called twice: its first call
