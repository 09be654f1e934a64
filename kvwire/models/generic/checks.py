"""The build's checks of the cached graph against the model's own logits on the probe: decoding
one token at a time after a prefill, and a prefill in two calls (the second of several tokens
continuing the first's state). A model the generic cache does not fit is refused here rather
than decoding wrong tokens."""
import torch

from ...graph import with_cache
from . import stepping

TOLERANCE = 1e-4  # relative to the logits' scale, float32


def close(a, b):
    """Whether logits `a` equal `b` within TOLERANCE of b's scale."""
    a, b = a.float(), b.float()
    return a.shape == b.shape and bool(((a - b).abs().max() <= TOLERANCE * max(1.0, b.abs().max().item())).item())


def check_decoding(name, backbone, head, probe, expected, steps=4):
    """Prefill the probe but its last `steps` tokens through the cached graph, then decode those one
    at a time: each position's logits must be the model's own. A layer that reads more than its
    keys and values from past positions (transformers' cache object, a position count) is refused
    here rather than decoding wrong tokens."""
    T = probe.shape[1]
    start = T - steps
    got = cached_logits(backbone, head, probe, [start, *range(start + 1, T + 1)])
    if not close(got, expected):
        raise ValueError(f"{name}: cached decoding does not reproduce the model's own logits (first at position "
                         f"{_first_difference(got, expected)} of a {T}-token probe, prefilled to {start}); its layers "
                         f"depend on more than their keys and values (positions read from transformers' cache "
                         f"object, chunked attention), which the generic path does not carry yet")


def check_chunks(name, backbone, head, probe, expected):
    """Prefill the probe in two calls, the second of several tokens continuing the first's state:
    each position's logits must be the model's own. Where they are not (a mixer whose multi-token
    call ignores the state it is handed, as transformers' Mamba-1 scan does), the stateful layers'
    mixers continue states one token at a time (`kvwire.models.generic.stepping`) and the check
    runs again. A model it still does not fit is refused: kvwire prefills prompts in chunks."""
    T = probe.shape[1]
    bounds = [T // 2, T]
    got = cached_logits(backbone, head, probe, bounds)
    if close(got, expected):
        return
    stateful = [part for part in backbone.layers if part.states is not None]
    tried = ""
    if stateful and all(part.mixer is not None for part in stateful):
        for part in stateful:
            part.states.steps = True
            stepping.install(part.mixer)
        got = cached_logits(backbone, head, probe, bounds)
        if close(got, expected):
            return
        tried = ", also with its state-keeping mixers continuing one token at a time"
    raise ValueError(f"{name}: a prompt prefilled in chunks does not reproduce the model's own logits (first at "
                     f"position {_first_difference(got, expected)} of a {T}-token probe prefilled in calls of "
                     f"{bounds[0]} and {T - bounds[0]} tokens{tried}); its layers do not carry their state across "
                     f"calls of several tokens, and kvwire prefills prompts in chunks")


def cached_logits(backbone, head, probe, bounds):
    """Logits (B, T, V) of the probe (B, T) run through the cached graph in calls ending at each of
    `bounds` (increasing, the last T)."""
    cached = with_cache(backbone)
    B, T = probe.shape
    device = probe.device
    cache = cached.init_cache(B, T)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    positions = torch.arange(T, device=device)[None].expand(B, T)
    got, at = [], 0
    with torch.no_grad():
        for end in bounds:
            hidden, cache = cached(probe[:, at:end], positions[:, at:end], at, mask, cache)
            got.append(head(hidden))
            at = end
    return torch.cat(got, dim=1)


def _first_difference(got, expected):
    scale = TOLERANCE * max(1.0, expected.abs().max().item())
    return int(((got.float() - expected.float()).abs().amax(dim=(0, 2)) > scale).nonzero()[0])
