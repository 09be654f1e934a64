"""`kw.steer.calibrate`: the layer (and site) and strength at which a steering direction moves the
A/B logit difference most while staying under a damage limit (KL from the unsteered model,
perplexity increase on neutral text)."""
import math
from dataclasses import dataclass, field

import torch

from ..graph import numbered_blocks
from ..layers.site import ALL_SITES
from .evaluate import Reference, check_strengths, json_text
from .operation import Operation
from .vector import ControlVector, parse_layers


@dataclass
class Calibration:
    """`calibrate`'s report. Grids are (candidates, strengths): `logit_diff` (mean A/B logit
    difference), `kl`, `ppl_increase`, `allowed` (nonzero strength within the limits); `slopes`
    (candidates,) the mean steerability. `candidates` label the rows ("12" or "12 attn_out"),
    `settings` give their (layer, site).

    `choice`: the chosen setting (layer, site, strength, its measurements); `vector`: the vector
    restricted to the chosen block and site, ready to save, carrying its recommended strength
    (`vector.strength`, saved in the file), so `lm.steer/ablate/clamp(report.vector)` apply the
    choice. An added vector is scaled by the chosen strength and recommends 1 (llama.cpp's default
    scale reads the file right too); an ablation or clamp keeps its direction and recommends
    `choice["strength"]`.
    """

    candidates: list
    settings: list
    strengths: list
    logit_diff: list
    kl: list
    ppl_increase: list
    slopes: list
    allowed: list
    max_kl: float
    max_ppl_increase: float
    choice: dict
    choice_index: tuple
    vector: ControlVector = field(repr=False)

    def to_dict(self):
        return {k: v for k, v in vars(self).items() if k != "vector"}

    def to_json(self, path=None):
        """The report (without the vector) as JSON text; written to `path` too when one is given."""
        return json_text(self.to_dict(), path)

    def plot(self, path, title=None):
        """The heatmap of the logit difference over candidates x strengths (matplotlib) into `path`;
        settings over the limit hatched, the choice boxed."""
        from .evaluate_plot import plot_calibration
        plot_calibration(self, path, title)


def calibrate(lm, vector, dataset, layers=None, strengths=(-2.0, -1.0, -0.5, 0.5, 1.0, 2.0), *, sites=None,
              max_kl=0.5, max_ppl_increase=0.25, neutral=None, neutral_tokens=128, batch_size=64):
    """Search layers (or layers x sites) x strengths for the highest mean A/B logit difference whose
    side effects stay within `max_kl` and `max_ppl_increase` (see `evaluate` for the measures).

    Each candidate (one block, one site) is one `evaluate` of the vector restricted to it, every
    strength a row of the same batches; the unsteered reference is computed once. A zero strength is
    measured but never chosen (it does not steer). The highest score picks the sign too: give
    negative strengths to let it find that the vector points the wrong way.

    Args:
        lm: a CausalLM with a tokenizer.
        vector: a `kw.ControlVector` (its operation and site; candidates are its blocks) or one (D,)
            direction, added at every candidate block.
        dataset: as `evaluate` (an ABDataset, a shipped name, a JSONL path or records).
        layers: the blocks to try: None (every block the vector has; every block for a tensor), ints
            or "A-B".
        strengths: the strengths to try (at least two different numbers).
        sites: sites to try (`kvwire.layers.site.ALL_SITES`); None: the vector's own ("block_out").
        max_kl: the most KL(unsteered || steered) per neutral token allowed (nats); None: no limit.
        max_ppl_increase: the most perplexity / unsteered perplexity - 1 allowed; None: no limit.
        neutral: as `evaluate`.
        neutral_tokens: as `evaluate`.
        batch_size: as `evaluate`.
    Returns a `Calibration`. A limit no nonzero setting meets is a ValueError naming the best
    setting found and the least damaging one.

    Example:
        >>> report = kw.steer.calibrate(lm, vec, "sentiment-ab", layers="4-20", strengths=[-4, -2, 2, 4])
        >>> report.choice          # {"layer": 9, "site": "block_out", "strength": 4.0, ...}
        >>> report.plot("calibration.png"); report.vector.save("happy-calibrated.gguf")
    """
    strengths = check_strengths(strengths)
    limits = {"max_kl": max_kl, "max_ppl_increase": max_ppl_increase}
    for name, value in limits.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value >= 0 or math.isinf(value)):
            raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")
    settings, base = _settings(lm, vector, layers, sites)
    reference = Reference(lm, dataset, neutral, neutral_tokens, batch_size)
    runs = [reference.measure(Operation.of(_restricted(base, layer, site)), strengths) for layer, site in settings]
    diff, kl, ppl = (torch.tensor([getattr(r, key) for r in runs]) for key in ("logit_diff", "kl", "ppl_increase"))
    allowed = (torch.tensor(strengths) != 0)[None].expand_as(diff).clone()
    if max_kl is not None:
        allowed &= kl <= max_kl
    if max_ppl_increase is not None:
        allowed &= ppl <= max_ppl_increase
    labels = [str(layer) if len({s for _, s in settings}) == 1 else f"{layer} {site}" for layer, site in settings]

    def describe(r, c):
        return (f"layer {labels[r]} at strength {strengths[c]:g}: logit difference {float(diff[r, c]):+.3f}, "
                f"KL {float(kl[r, c]):.3f}, perplexity {100 * float(ppl[r, c]):+.1f}%")
    if not allowed.any():
        moving = (torch.tensor(strengths) != 0)[None].expand_as(diff)
        best = _argmax(torch.where(moving, diff, -math.inf))
        gentlest = _argmax(torch.where(moving, -kl, -math.inf))
        raise ValueError(f"no setting keeps KL <= {max_kl} and the perplexity increase <= {max_ppl_increase} "
                         f"(strength 0 does not count); the best found: {describe(*best)}; the least damaging: "
                         f"{describe(*gentlest)}")
    r, c = _argmax(torch.where(allowed, diff, -math.inf))
    layer, site = settings[r]
    strength = strengths[c]
    choice = {"layer": layer, "site": site, "strength": strength, "logit_diff": float(diff[r, c]),
              "kl": float(kl[r, c]), "ppl_increase": float(ppl[r, c]), "slope_mean": runs[r].slope_mean,
              "operation": base.operation}
    chosen = _restricted(base, layer, site)
    return Calibration(labels, [list(s) for s in settings], strengths, diff.tolist(), kl.tolist(), ppl.tolist(),
                       [run.slope_mean for run in runs], allowed.tolist(), max_kl, max_ppl_increase, choice, (r, c),
                       _recommending(chosen * strength if base.operation == "add" else chosen,
                                     1.0 if base.operation == "add" else strength))


def _settings(lm, vector, layers, sites):
    """([(layer, site)] candidates, the vector as a ControlVector), checked against the model."""
    blocks = numbered_blocks(lm.backbone)
    if isinstance(vector, torch.Tensor):
        if vector.dim() != 1:
            raise ValueError(f"a direction must be (D,), got shape {tuple(vector.shape)}; give a ControlVector "
                             f"for one direction per block")
        chosen = parse_layers(sorted(blocks) if layers is None else layers, blocks)
        vector = ControlVector({i: vector for i in chosen})
    elif not isinstance(vector, ControlVector):
        raise TypeError(f"calibrate expects a kw.ControlVector or a (D,) direction tensor, got "
                        f"{type(vector).__name__}")
    chosen = parse_layers(vector.layers if layers is None else layers, blocks)
    missing = [i for i in chosen if i not in vector.directions]
    if missing:
        raise ValueError(f"the vector has no direction for blocks {missing}; it has blocks {vector.layers}")
    sites = [vector.site] if sites is None else ([sites] if isinstance(sites, str) else list(sites))
    bad = [s for s in sites if s not in ALL_SITES]
    if bad or not sites:
        raise ValueError(f"sites must be among {ALL_SITES}, got {sites!r}")
    return [(i, s) for s in sites for i in chosen], vector


def _recommending(vector, strength):
    """`vector` carrying its recommended strength (saved with it: `lm.steer/ablate/clamp(vector)`
    then apply the calibrated setting)."""
    return ControlVector(vector.directions, vector.model_hint, vector.method, vector.operation, vector.site,
                         vector.fingerprint, strength)


def _restricted(vector, layer, site):
    return ControlVector({layer: vector.directions[layer]}, vector.model_hint, vector.method, vector.operation, site,
                         vector.fingerprint)


def _argmax(grid):
    flat = int(grid.flatten().argmax())
    return flat // grid.shape[1], flat % grid.shape[1]
