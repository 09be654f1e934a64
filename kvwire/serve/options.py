"""A request's fields as engine options (sampler, stops, budget, steering), checked, and the served
model with its named control vectors."""
import keyword

import torch

from ..generate import request as checks
from ..generate.constrain import Constraint
from .errors import APIError

MAX_CHOICES = 16  # n x prompts a request may ask for: bounds one request's share of the slots


def steered_model(lm, control_vectors):
    """`lm` with each named control vector put in at strength 0 (requests set their own strengths
    through the runtime inputs `<name>_strength`): added, or projected out when the vector's file
    says its operation is "ablate" (strength 1 then removes the component), at the vector's site.

    Args: control_vectors: {name: kw.ControlVector}; names must be Python identifiers. A vector
        made for clamping is refused (its bounds are not in the file).

    Example:
        >>> served = steered_model(lm, {"happy": ControlVector.load("happy.gguf")})
        >>> sorted(served.cached.runtime_inputs)
        ['happy_start', 'happy_strength']
    """
    check_names(control_vectors)
    for name, vector in control_vectors.items():
        operation = getattr(vector, "operation", "add")
        if operation == "ablate":
            lm = lm.ablate(vector, strength=0.0, name=name)
        elif operation == "add":
            lm = lm.steer(vector, 0.0, name=name)
        else:
            raise ValueError(f"control vector {name!r} is made for {operation!r}; a server steers with vectors that "
                             f"add or ablate (a clamp's bounds are not in its file)")
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


def steer_inputs(request, names):
    """{"<name>_strength": value} for every control vector (0 for the names a request leaves out, so
    equal choices share prefix-store entries)."""
    asked = request.steer or {}
    unknown = sorted(set(asked) - set(names))
    if unknown:
        served = ", ".join(names) if names else "none (start the server with --control-vector NAME=FILE)"
        raise APIError(f"unknown control vector names {unknown} in steer; this server has {served}",
                       param="steer", code="invalid_value")
    values = {f"{name}_strength": float(asked.get(name, 0.0)) for name in names}
    checks.runtime_values(values, {key: torch.float32 for key in values}, param=lambda key: f"steer.{key[:-9]}")
    return values


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
