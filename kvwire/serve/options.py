"""A request's fields as engine options (sampler, stops, budget, steering), checked, and the served
model with its named control vectors."""
import dataclasses
import keyword
import math

import torch

from ..generate import request as checks
from ..generate.constrain import Constraint
from ..steer.ops import LIMIT
from .errors import APIError

MAX_CHOICES = 16  # n x prompts a request may ask for: bounds one request's share of the slots


def steered_model(lm, control_vectors):
    """`lm` with each named control vector put in, inert (requests set their own values through
    runtime inputs): added at strength 0 (`<name>_strength`), projected out at strength 0 when the
    vector's file says its operation is "ablate" (strength 1 then removes the component), or
    clamped with unbounded bounds when it says "clamp" (`<name>_lo`, `<name>_hi`), at the vector's
    site.

    Args: control_vectors: {name: kw.ControlVector}; names must be Python identifiers.

    Example:
        >>> served = steered_model(lm, {"happy": ControlVector.load("happy.gguf")})
        >>> sorted(served.cached.runtime_inputs)
        ['happy_end', 'happy_start', 'happy_strength']
    """
    check_names(control_vectors)
    for name, vector in control_vectors.items():
        operation = getattr(vector, "operation", "add")
        if operation == "ablate":
            lm = lm.ablate(vector, strength=0.0, name=name)
        elif operation == "clamp":  # unbounded by default (inert): requests bound it, not the file's recommendation
            lm = lm.clamp(dataclasses.replace(vector, strength=None), name=name)
        elif operation == "add":
            lm = lm.steer(vector, 0.0, name=name)
        else:
            raise ValueError(f"control vector {name!r} is made for {operation!r}; a server steers with vectors that "
                             f"add, ablate or clamp")
    return lm


def check_names(names):
    """Refuse control vector names that are not Python identifiers (they name graph inputs)."""
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"control vector name {name!r} is not a Python identifier; expected a name like "
                             f"'happy' or 'formal_tone' (--control-vector NAME=FILE)")


def sampler(request):
    """temperature 0: greedy; > 0: sampling at that temperature, within top_p when it is below 1."""
    return checks.temperature_sampler(request.temperature, request.top_p)


def stop_strings(request):
    return checks.stop_strings(request.stop)


def steer_inputs(request, names, clamps=()):
    """{"<name>_strength": value} for every control vector (0 for the names a request leaves out, so
    equal choices share prefix-store entries); for the vectors in `clamps` (made to clamp),
    {"<name>_lo": a, "<name>_hi": b} from the request's {"lo": a, "hi": b} (unbounded when left out)."""
    asked = request.steer or {}
    unknown = sorted(set(asked) - set(names))
    if unknown:
        served = ", ".join(names) if names else "none (start the server with --control-vector NAME=FILE)"
        raise APIError(f"unknown control vector names {unknown} in steer; this server has {served}",
                       param="steer", code="invalid_value")
    values = {}
    for name in names:
        value = asked.get(name)
        if name in clamps:
            values.update(_bounds(name, value))
        elif value is not None and not isinstance(value, (int, float)):
            raise APIError(f"steer.{name} is {value.model_dump()}, but {name!r} is a vector to add or ablate: "
                           f"expected a strength (a number); bounds belong to vectors made to clamp",
                           param=f"steer.{name}", code="invalid_value")
        else:
            values[f"{name}_strength"] = float(0.0 if value is None else value)
    checks.runtime_values(values, {key: torch.float32 for key in values},
                          param=lambda key: f"steer.{key.rsplit('_', 1)[0]}")
    return values


def _bounds(name, value):
    """A clamp vector's {"<name>_lo", "<name>_hi"} from the request's bounds (None: unbounded)."""
    if isinstance(value, (int, float)):
        raise APIError(f"steer.{name} is {value}, but {name!r} is a vector made to clamp: expected its bounds "
                       f'{{"lo": a, "hi": b}} (either may be left out)', param=f"steer.{name}", code="invalid_value")
    lo, hi = (None, None) if value is None else (value.lo, value.hi)
    for side, bound in (("lo", lo), ("hi", hi)):
        if bound is not None and not math.isfinite(bound):
            raise APIError(f"steer.{name}.{side} is {bound}; expected a finite number (leave it out for no bound)",
                           param=f"steer.{name}", code="invalid_value")
    if lo is not None and hi is not None and lo > hi:
        raise APIError(f"steer.{name}: lo {lo} > hi {hi}; expected lo <= hi", param=f"steer.{name}",
                       code="invalid_value")
    return {f"{name}_lo": -LIMIT if lo is None else float(lo), f"{name}_hi": LIMIT if hi is None else float(hi)}


def choices(request, prompts):
    n = 1 if request.n is None else checks.positive_int(request.n, "n")
    if n * prompts > MAX_CHOICES:
        raise APIError(f"n x prompts must be at most {MAX_CHOICES}; got n={n} for {prompts} "
                       f"prompt(s)", param="n", code="invalid_value")
    return n


def budget(request, prompt_length, max_length, limits):
    """New tokens for a prompt: max_tokens (chat: max_completion_tokens too), by default what is left
    of the context (at most `limits.max_tokens`); refused when it or the prompt does not fit, or it
    asks for more than `limits` allow."""
    asked = getattr(request, "max_completion_tokens", None)
    field = "max_completion_tokens" if asked is not None else "max_tokens"
    asked = request.max_tokens if asked is None else asked
    cap = limits.check_new_tokens(asked, field)
    prompt_param = "messages" if hasattr(request, "messages") else "prompt"
    new = checks.new_tokens(prompt_length, asked, context=max_length, context_name="this server's context",
                            default=None, param=field, prompt_param=prompt_param)
    return new if asked is not None or cap is None else min(new, cap)


def constraint(request):
    """The `Constraint` a request's response_format asks for, or None ("text" or absent)."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json_object("response_format")
    field = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}[fmt.type]
    value = getattr(fmt, field)
    if fmt.type == "json_schema":
        value = None if value is None else value.schema_
        field = "json_schema.schema"
    if value is None:
        raise APIError(f"response_format.{field} is required with type {fmt.type!r}", param=f"response_format.{field}",
                       code="invalid_value")
    make = {"json_schema": Constraint.json_schema, "regex": Constraint.regex, "grammar": Constraint.grammar}[fmt.type]
    return make(value, param=f"response_format.{field}")
