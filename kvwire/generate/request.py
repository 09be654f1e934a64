"""What a generation request may hold, checked in one place for every door: the Python API
(`lm.generate`, `stream`, `chat`), the engine (`Engine.submit`) and the HTTP server. One mistake
gives one error type and one message, naming what was received and what was expected.

Mistakes in a request's values raise `RequestError` (a ValueError that also names the field, so
the server answers 400 with that field as OpenAI's `param`); a value of the wrong Python type
given to the Python API raises TypeError.

Example:
    >>> new_tokens(5, max_new_tokens=0)
    Traceback (most recent call last):
    RequestError: max_new_tokens must be an int >= 1, got 0
"""
import math
import operator

import numpy as np
import torch

FLOAT32_MAX = 3.4028234663852886e38  # strengths and other runtime inputs are float32 graph inputs
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes
DEFAULT_NEW_TOKENS = 32


class RequestError(ValueError):
    """A request that cannot run as given.

    Args:
        message: what was received and what was expected.
        param: the request field it concerns ("max_new_tokens", "stop", "steer.happy"), or None.
        code: the kind of mistake: "invalid_value" or "context_length_exceeded".
    """

    def __init__(self, message, param=None, code="invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def positive_int(value, param):
    """`value` as an int >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise RequestError(f"{param} must be an int >= 1, got {value!r}", param)
    return int(value)


def new_tokens(prompt_length, max_new_tokens=None, max_length=None, *, context=None, context_name="the model's context",
               default=DEFAULT_NEW_TOKENS, param="max_new_tokens", prompt_param="prompt"):
    """How many tokens to generate after a prompt of `prompt_length` tokens.

    `max_new_tokens` (None: `default`, or what `max_length` leaves; a `default` of None: what
    `context` leaves) and `max_length` (prompt + new tokens; the smaller limit wins) as `generate`
    takes them; the result must fit `context` tokens (None: no limit), called `context_name` in the
    message. `param` and `prompt_param` name the fields in messages (the server's "max_tokens",
    "messages").
    """
    if max_new_tokens is not None:
        max_new_tokens = positive_int(max_new_tokens, param)
    if max_length is not None:
        max_length = positive_int(max_length, "max_length")
        if prompt_length >= max_length:
            raise RequestError(f"the prompt has {prompt_length} tokens but max_length is {max_length}", "max_length",
                               "context_length_exceeded")
        room = max_length - prompt_length
        new = room if max_new_tokens is None else min(max_new_tokens, room)
    else:
        if context is not None and prompt_length >= context:
            _prompt_fills(prompt_length, context, context_name, prompt_param)
        if max_new_tokens is not None:
            new = max_new_tokens
        elif default is not None:
            new = default
        elif context is not None:
            new = context - prompt_length
        else:
            raise RequestError(f"{param} is required: this model has no context length to take a default from",
                               param)
    fits(prompt_length, new, context, context_name, param, prompt_param)
    return new


def fits(prompt_length, new, limit, limit_name, param="max_new_tokens", prompt_param="prompt"):
    """Refuse a prompt + `new` tokens that do not fit `limit` tokens (None: no limit)."""
    if limit is None or prompt_length + new <= limit:
        return
    if prompt_length >= limit:
        _prompt_fills(prompt_length, limit, limit_name, prompt_param)
    raise RequestError(f"prompt ({prompt_length} tokens) + {new} new tokens exceeds {limit_name} of {limit} "
                       f"tokens: at most {limit - prompt_length} new tokens fit", param, "context_length_exceeded")


def _prompt_fills(prompt_length, limit, limit_name, param):
    raise RequestError(f"the prompt has {prompt_length} tokens, but {limit_name} is {limit} tokens (prompt + new "
                       f"tokens); expected a shorter prompt", param, "context_length_exceeded")


def token_ids(ids, vocab_size, param="prompt"):
    """A prompt's token ids as a list of ints, non-empty and inside the vocabulary."""
    ids = [int(t) for t in ids]
    if not ids:
        raise RequestError(f"the {param} is empty; expected at least one token", param)
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise RequestError(f"token ids must lie in [0, {vocab_size}); got values in [{low}, {high}]", param)
    return ids


def id_tensor(ids, vocab_size, param="token_ids"):
    """Check an integer tensor of token ids (any shape, non-empty, inside the vocabulary)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{param} must be an integer tensor, got {got}")
    if ids.numel() == 0:
        raise RequestError(f"the {param} is empty; expected at least one token", param)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise RequestError(f"token ids must lie in [0, {vocab_size}); got values in [{low}, {high}]", param)


def uncached_input(token_ids, vocab_size, context, device):
    """What `lm(token_ids)` accepts: (B, T) ids in the vocabulary on the model's device, T within the
    model's context (None: no limit)."""
    if isinstance(token_ids, torch.Tensor) and token_ids.device != device:
        raise RequestError(f"token_ids are on {token_ids.device} but the model is on {device}; pass "
                           f"token_ids.to(lm.device)", "token_ids")
    id_tensor(token_ids, vocab_size)
    if token_ids.dim() != 2:
        raise RequestError(f"lm(token_ids) expects a (B, T) tensor, got shape {tuple(token_ids.shape)}"
                           + ("; use ids[None] for one row" if token_ids.dim() == 1 else ""), "token_ids")
    length(token_ids.shape[1], context, "the input", "token_ids")


def length(tokens, context, what="the prompt", param="prompt"):
    """Refuse `tokens` tokens past the model's context (positions it has no embedding or rotary range for)."""
    if context is not None and tokens > context:
        raise RequestError(f"{what} has {tokens} tokens, more than the model's context of {context} tokens",
                           param, "context_length_exceeded")


def stop_strings(stop, param="stop"):
    """`stop` (None, a str or a list of str) as a tuple of non-empty strings."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise RequestError(f"stop strings must be non-empty str, got {stops!r:.80}", param)
    return stops


def stop_token_ids(ids, vocab_size, param="stop_token_ids"):
    """stop_token_ids as a tuple of ints: an int (Python or NumPy), a list of them, or an integer
    tensor or array (0-d or 1-D)."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.dtype in (torch.bool, np.bool_) or ids.ndim > 1 or not _integer_dtype(ids.dtype):
            raise TypeError(f"{param} must be integer ids (0-d or 1-D), got a {ids.dtype} "
                            f"{type(ids).__name__} of shape {tuple(ids.shape)}")
        ids = ids.reshape(-1).tolist()
    elif _as_int(ids) is not None:
        ids = [ids]
    elif not isinstance(ids, (list, tuple, set, frozenset)):
        raise TypeError(f"{param} must be an int, a list of ints or an integer tensor; got {type(ids).__name__}")
    out = []
    for item in ids:
        i = _as_int(item)
        if i is None:
            raise TypeError(f"{param} must be integer token ids, got {item!r} ({type(item).__name__})")
        if not 0 <= i < vocab_size:
            raise RequestError(f"stop token id {i} is outside the vocabulary [0, {vocab_size})", param)
        out.append(i)
    return tuple(out)


def repetition_penalty(value, param="repetition_penalty"):
    """A penalty > 0 as a float (any real number: Python, NumPy, a 0-d tensor), or None."""
    if value is None:
        return None
    number = _as_float(value)
    if number is None or not (math.isfinite(number) and number > 0):
        raise RequestError(f"{param} must be a finite number > 0, got {value!r}", param)
    return number


def seed(value, rows=1, param="seed"):
    """A seed for torch's generator, or None: an int (an integral float is taken as one) such that
    the seeds of `rows` rows, value + i, all lie in [-2**63, 2**64)."""
    if value is None:
        return None
    number, real = _as_int(value), _as_float(value)
    if number is None and real is not None and real.is_integer():  # 7.0 is seed 7
        number = int(real)
    high = SEED_RANGE[1] - rows + 1
    if number is None or not SEED_RANGE[0] <= number < high:
        limit = "2**64" if rows == 1 else f"2**64 - {rows - 1} (row i draws from seed + i, {rows} rows)"
        raise RequestError(f"{param} must be an int in [-2**63, {limit}), got {value!r:.40}", param)
    return number


def sampler(value, beams=True):
    """The sampler to use: `value`, or kw.Greedy() for None; `beams=False` where rows sample one by
    one (the engine: beam search reorders rows, so it runs through `generate`)."""
    from .samplers import BeamSearch, Greedy, Sampler

    if value is None:
        return Greedy()
    if not isinstance(value, (Sampler, BeamSearch)):
        raise TypeError(f"sampler must be a kvwire sampler (kw.Greedy(), kw.TopP(0.9), ...), got {value!r:.80}")
    if isinstance(value, BeamSearch) and not beams:
        raise RequestError("the engine samples each row on its own (kw.Greedy, kw.TopP, ...); beam search runs "
                           "through generate", "sampler")
    return value


def top_logprobs(value, param="top_logprobs"):
    """How many alternatives to record per token: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise RequestError(f"{param} must be an int >= 0, got {value!r}", param)
    return int(value)


def temperature_sampler(temperature=None, top_p=None):
    """OpenAI's sampling fields as a sampler: temperature 0 is greedy; > 0 samples at that
    temperature (default 1), within `top_p` when it is below 1."""
    from .samplers import Greedy, Random, TopP

    t = 1.0 if temperature is None else temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}",
                           "temperature")
    if top_p is not None and not (isinstance(top_p, (int, float)) and math.isfinite(top_p) and 0 < top_p <= 1):
        raise RequestError(f"top_p must lie in (0, 1], got {top_p!r}", "top_p")
    if t == 0:
        return Greedy()
    return TopP(float(top_p), temperature=float(t)) if top_p is not None and top_p < 1 else Random(float(t))


def runtime_values(inputs, known, param=None):
    """One row's runtime-input values, {name: number}, checked against the graph's runtime inputs
    `known` ({name: dtype}). `param` (default: the input's name) names a value in messages."""
    inputs = dict(inputs or {})
    unknown = sorted(set(inputs) - set(known))
    if unknown:
        raise RequestError(f"unknown runtime inputs {unknown}; this model takes {sorted(known) or 'none'}", "inputs")
    out = {}
    for name, value in inputs.items():
        field = param(name) if callable(param) else name
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise TypeError(f"runtime input {field!r} must be a number, got {value!r:.40}")
        if known[name].is_floating_point and not abs(number) <= FLOAT32_MAX:
            raise RequestError(f"{field} must be a finite float32 number, got {number!r}", field)
        out[name] = number
    return out


def batch_inputs(inputs, known, batch_size):
    """generate's `inputs` ({name: (B,) tensor}) as one {name: value} per row: names, dtypes and
    shapes checked here, each row's values by `runtime_values` when `Engine.submit` takes it."""
    inputs = dict(inputs or {})
    runtime_values({name: 0 for name in inputs}, known)  # unknown names first
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.dtype != known[name] or tuple(value.shape) != (batch_size,):
            got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            raise TypeError(f"runtime input {name!r} must be a {known[name]} tensor of shape ({batch_size},); "
                            f"got {got}")
    return [{name: value[i] for name, value in inputs.items()} for i in range(batch_size)]


def _integer_dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex
    return np.issubdtype(dtype, np.integer)


def _as_float(value):
    """value as a Python float if it is a real number (int, float, NumPy scalar, 0-d real tensor),
    not a bool; else None."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, torch.Tensor):
        return float(value) if value.dim() == 0 and not value.is_complex() else None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    return None


def _as_int(value):
    """value as a Python int if it is an integer (int, NumPy integer, 0-d integer tensor), not a
    bool; else None."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, torch.Tensor):
        return int(value) if value.dim() == 0 and _integer_dtype(value.dtype) else None
    try:
        return operator.index(value)
    except TypeError:
        return None


def prompt_rows(prompt, encode, vocab_size):
    """A prompt as token-id rows: a str, a non-empty list of str (encoded with `encode`), a 1-D or
    2-D id tensor, or a list of 1-D id tensors (rows of different lengths)."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() not in (1, 2):
            raise RequestError(f"a token-id prompt must be 1-D or 2-D, got shape {tuple(prompt.shape)}", "prompt")
        id_tensor(prompt, vocab_size)
        return [r.tolist() for r in prompt.reshape(-1, prompt.shape[-1])]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if isinstance(prompt, (list, tuple)) and prompt and all(is_id_row(p) for p in prompt):
        for row in prompt:  # rows of different lengths: a batch of ids, left-padded like text
            id_tensor(row, vocab_size)
        return [row.tolist() for row in prompt]
    raise TypeError("prompt must be a str, a non-empty list of str, a token-id tensor or a list of 1-D "
                    f"token-id tensors; got {prompt!r:.80}")


def is_id_row(p):
    return isinstance(p, torch.Tensor) and p.dim() == 1


def unicode_text(text, param="prompt"):
    """`text` if it is valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{param} holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}; "
                           f"expected valid Unicode text", param) from None
    return text


def message_texts(messages, param="messages"):
    """Check every string inside chat messages (contents, names, text parts) with `unicode_text`."""
    def walk(value, where):
        if isinstance(value, str):
            unicode_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")
    walk(messages, param)
    return messages


def encoded(tokenizer, text, vocab_size):
    """`text`'s token ids, checked against the model's vocabulary."""
    if tokenizer is None:
        raise RequestError("this model has no tokenizer; pass token ids instead of text", "prompt")
    if not isinstance(text, str):
        raise TypeError(f"expected a str to encode, got {type(text).__name__}")
    if not text:
        raise RequestError("the prompt is empty; expected at least one character", "prompt")
    unicode_text(text)
    return checked_vocab(tokenizer.encode(text), vocab_size, "the tokenizer gave token id {} for " + f"{text!r:.40}")


def checked_vocab(ids, vocab_size, what):
    """Token ids a tokenizer or template produced: an id past the model's vocabulary means the two
    do not match (not the caller's mistake). `what` names the id's source, "{}" standing for it."""
    if ids and max(ids) >= vocab_size:
        raise ValueError(f"{what.format(max(ids))}, but the model has {vocab_size} tokens: tokenizer and model "
                         f"do not match")
    return ids
