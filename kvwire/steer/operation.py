"""`Operation`: a steering operation "at strength s": the edit is made once, and a strength is a
set of its runtime inputs, so every strength of a sweep can be one row of a batch (`evaluate`,
`calibrate`)."""
from dataclasses import dataclass
from typing import Callable

import torch

from ..graph.edit import summarize_indices
from .ops import LIMIT
from .vector import ControlVector

BOUNDS = ("value", "lo", "hi")


@dataclass(frozen=True)
class Operation:
    """A steering edit and what a strength means for it.

    Args:
        build: lm -> the steered lm (built once; its strength lives in runtime inputs).
        inputs: strengths (S,) float32 tensor -> {runtime input name: (S,) tensor} of the built model
            (inputs left out keep their defaults).
        label: how reports name it.

    The constructors cover the steering API (runtime inputs named `<name>_...`, default "eval"; `when`
    the positions they act on, see `kvwire.steer.schedule`: in `evaluate` an example's prompt is the
    prompt and its answer what is generated, so when="generated" steers the answer alone):
    - `add(vector)`: s times the vector's direction added at each of its blocks (`lm.steer`);
    - `ablate(directions)`: the fraction s of the span removed (1: directional ablation; `lm.ablate`);
    - `clamp(directions, bound=)`: the projection held at s ("value"), at least s ("lo") or at most s
      ("hi") (`lm.clamp`);
    - `features(sae, {index: weight})`: each SAE feature set to (mode "set") or raised by ("add")
      weight * s (`lm.steer_features`);
    - `Operation.of(x)`: an Operation as is, or a `ControlVector` by its own operation.
    Any other edit with runtime inputs: give `build` and `inputs` yourself.

    Example:
        >>> op = Operation.add(vec)                      # or Operation.of(vec)
        >>> steered = op.build(lm)
        >>> op.inputs(torch.tensor([-1.0, 0.0, 1.0]))    # {"eval_strength": tensor([-1., 0., 1.])}
        >>> custom = Operation(lambda lm: lm.steer(vec, name="v"), lambda s: {"v_strength": 2 * s}, "2x vec")
    """

    build: Callable
    inputs: Callable
    label: str = "operation"

    @classmethod
    def of(cls, operation, when=None):
        """`operation` as an Operation: itself, or a ControlVector by its `operation` ("add",
        "ablate" or "clamp" with bound "value") on the positions `when` picks."""
        if isinstance(operation, Operation):
            if when is not None:
                raise ValueError(f"when={when!r} applies to a kw.ControlVector; operation {operation.label!r} is "
                                 f"built already: give when to its constructor")
            return operation
        if isinstance(operation, ControlVector):
            return getattr(cls, operation.operation)(operation, when=when)
        raise TypeError(f"operation must be a kw.steer.Operation or a kw.ControlVector, got "
                        f"{type(operation).__name__}")

    @classmethod
    def add(cls, vector, *, site=None, when=None, name="eval"):
        """s * direction added at each of `vector`'s blocks (at `site`, default the vector's)."""
        if not isinstance(vector, ControlVector):
            raise TypeError(f"Operation.add expects a kw.ControlVector, got {type(vector).__name__}")
        plain = vector if vector.operation == "add" else ControlVector(
            vector.directions, vector.model_hint, vector.method, "add", vector.site, vector.fingerprint)
        return cls(lambda lm: lm.steer(plain, 0.0, site=site, when=when, name=name), _named(name, "strength"),
                   f"add at {_where(vector, site, when=when)}")

    @classmethod
    def ablate(cls, directions, *, layers=None, site=None, when=None, name="eval"):
        """The fraction s of the span of `directions` removed (see `lm.ablate` for the arguments)."""
        return cls(lambda lm: lm.ablate(directions, layers=layers, site=site, strength=0.0, when=when, name=name),
                   _named(name, "strength"), f"ablate at {_where(directions, site, layers, when)}")

    @classmethod
    def clamp(cls, directions, *, layers=None, site=None, bound="value", when=None, name="eval"):
        """The projection on `directions` held at s (bound "value"), at least s ("lo") or at most s
        ("hi") (see `lm.clamp` for the other arguments)."""
        if bound not in BOUNDS:
            raise ValueError(f"clamp bound must be one of {BOUNDS}, got {bound!r}")

        def inputs(s):
            lo = s if bound != "hi" else torch.full_like(s, -LIMIT)
            hi = s if bound != "lo" else torch.full_like(s, LIMIT)
            return {f"{name}_lo": lo, f"{name}_hi": hi}
        return cls(lambda lm: lm.clamp(directions, 0.0, 0.0, layers=layers, site=site, when=when, name=name), inputs,
                   f"clamp ({bound}) at {_where(directions, site, layers, when)}")

    @classmethod
    def features(cls, sae, features, *, mode="set", layer=None, site=None, when=None, name="eval"):
        """SAE features {index: weight}: each set to (mode "set") or raised by ("add") weight * s."""
        if mode not in ("set", "add"):
            raise ValueError(f"Operation.features takes mode 'set' or 'add', got {mode!r}; for bounds give "
                             f"Operation(build, inputs) with the `<name>_f<i>_lo/_hi` inputs")
        if not isinstance(features, dict) or not features:
            raise TypeError(f"features must be a non-empty {{feature index: weight}} dict, got {features!r:.60}")
        weights = {i: float(w) for i, w in features.items()}
        return cls(lambda lm: lm.steer_features(sae, {i: 0.0 for i in weights}, mode=mode, layer=layer, site=site,
                                                when=when, name=name),
                   lambda s: {f"{name}_f{i}": w * s for i, w in weights.items()},
                   f"SAE features {sorted(weights)} ({mode}){_on(when)}")


def _named(name, what):
    return lambda s: {f"{name}_{what}": s}


def _where(directions, site, layers=None, when=None):
    if isinstance(directions, ControlVector):
        return f"blocks {summarize_indices(directions.layers)}, {site or directions.site}{_on(when)}"
    return f"blocks {'all' if layers is None else layers}, {site or 'block_out'}{_on(when)}"


def _on(when):
    """A label's schedule part: nothing for every position."""
    if when in (None, "all"):
        return ""
    if isinstance(when, str):
        return f", {when} positions"
    return f", positions >= {when}" if isinstance(when, int) else f", positions in [{when[0]}, {when[1]})"
