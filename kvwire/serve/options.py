"""A request's fields as engine options (sampler, stops, budget, steering), checked, and the served
model with its named control vectors."""
import keyword
import math

from ..generate import samplers
from .errors import APIError

_FLOAT32_MAX = 3.4028234663852886e38  # strengths are float32 graph inputs
MAX_CHOICES = 16  # n x prompts a request may ask for: bounds one request's share of the slots


def steered_model(lm, control_vectors):
    """`lm` with each named control vector added at strength 0 (requests set their own strengths
    through the runtime inputs `<name>_strength`).

    Args: control_vectors: {name: kw.ControlVector}; names must be Python identifiers.

    Example:
        >>> served = steered_model(lm, {"happy": ControlVector.load("happy.gguf")})
        >>> sorted(served.cached.runtime_inputs)
        ['happy_start', 'happy_strength']
    """
    check_names(control_vectors)
    for name, vector in control_vectors.items():
        lm = lm.steer(vector, 0.0, name=name)
    return lm


def check_names(names):
    """Refuse control vector names that are not Python identifiers (they name graph inputs)."""
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"control vector name {name!r} is not a Python identifier; expected a name like "
                             f"'happy' or 'formal_tone' (--control-vector NAME=FILE)")


def sampler(request):
    """temperature 0: greedy; > 0: sampling at that temperature, within top_p when it is below 1."""
    t = 1.0 if request.temperature is None else float(request.temperature)  # OpenAI's default
    if not math.isfinite(t) or t < 0:
        raise APIError(f"temperature must be a finite number >= 0 (0 = greedy), got {request.temperature!r}",
                       param="temperature", code="invalid_value")
    top_p = request.top_p
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise APIError(f"top_p must lie in (0, 1], got {top_p!r}", param="top_p", code="invalid_value")
    if t == 0:
        return samplers.Greedy()
    if top_p is not None and top_p < 1:
        return samplers.TopP(float(top_p), temperature=t)
    return samplers.Random(t)


def stop_strings(request):
    stop = request.stop
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise APIError(f"stop strings must be non-empty, got {stop!r}", param="stop", code="invalid_value")
    return stops


def steer_inputs(request, names):
    """{"<name>_strength": value} for every control vector (0 for the names a request leaves out, so
    equal choices share prefix-store entries)."""
    asked = request.steer or {}
    unknown = sorted(set(asked) - set(names))
    if unknown:
        served = ", ".join(names) if names else "none (start the server with --control-vector NAME=FILE)"
        raise APIError(f"unknown control vector names {unknown} in steer; this server has {served}",
                       param="steer", code="invalid_value")
    for name, value in asked.items():
        if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
            raise APIError(f"steer.{name} must be a finite float32 number, got {value!r}", param=f"steer.{name}",
                           code="invalid_value")
    return {f"{name}_strength": float(asked.get(name, 0.0)) for name in names}


def choices(request, prompts):
    n = request.n
    if n < 1 or n * prompts > MAX_CHOICES:
        raise APIError(f"n must be >= 1 and n x prompts at most {MAX_CHOICES}; got n={n} for {prompts} "
                       f"prompt(s)", param="n", code="invalid_value")
    return n


def budget(request, prompt_length, max_length):
    """New tokens for a prompt: max_tokens (chat: max_completion_tokens too), by default what is left
    of the context; refused when it or the prompt does not fit."""
    asked = getattr(request, "max_completion_tokens", None)
    field = "max_completion_tokens" if asked is not None else "max_tokens"
    asked = request.max_tokens if asked is None else asked
    if asked is not None and asked < 1:
        raise APIError(f"{field} must be >= 1, got {asked}", param=field, code="invalid_value")
    if prompt_length >= max_length:
        raise APIError(f"the prompt has {prompt_length} tokens, but this server's context is {max_length} tokens "
                       f"(prompt + completion)", param="messages" if hasattr(request, "messages") else "prompt",
                       code="context_length_exceeded")
    room = max_length - prompt_length
    if asked is not None and asked > room:
        raise APIError(f"{field} is {asked}, but the prompt has {prompt_length} tokens and this server's context "
                       f"is {max_length}: at most {room} new tokens fit", param=field,
                       code="context_length_exceeded")
    return room if asked is None else asked
