"""kvwire's analysis endpoints over the served (unsteered) model: activations at named sites,
activation patching, and the evaluation of a steering vector.

    POST /kvwire/capture  {input, sites?, layers?, encoding_format?} -> each prompt's activations
    POST /kvwire/patch    {clean, corrupted, answers, sites?, layers?, positions?, position_map?}
                          -> logit difference and fraction recovered per (site, layer, position)
    POST /kvwire/evaluate {vector, strengths, dataset? | examples?, neutral?, neutral_tokens?,
                           generated_only?}
                          -> `kw.steer.evaluate(...).to_dict()`: A/B logit difference, slopes, KL and
                          perplexity per strength

Activations come as base64 of little-endian float32 with their shape (`encoding_format` "base64",
the default) or as nested JSON lists ("float"), as OpenAI's embeddings do. What one request may ask
is bounded (`AnalysisLimits`: values a capture holds, rows a patching sweep runs, an evaluation's
strengths, examples and neutral tokens); past a bound, a 400 names it. With `enabled=False`
(`kvwire serve --no-analysis`) all three answer 403.

They run off the event loop with the engine paused (`ServedVectors.exclusive`: they trace the
graph, which must not overlap a forward on the engine's thread), and give the engine turns between
their batches (`kvwire.steer.turns`, `kvwire.serve.bridge.Gate.turn`): running requests keep
decoding while a large evaluation runs.
"""
import asyncio
import base64
import math
from dataclasses import dataclass
from typing import Literal, Union

from fastapi import Depends
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from ..generate.request import RequestError, length
from ..layers.site import ALL_SITES
from ..steer import ABDataset, ControlVector, Operation, dataset as shipped_dataset, evaluate, patch
from ..steer.capture import Capture, read_sites, site_reads, token_rows
from ..steer.dataset import SHIPPED
from ..steer.evaluate import check_strengths
from ..steer.gguf_io import OPERATIONS
from .errors import APIError, from_request_error
from .inline_wire import decode_direction
from .schemas import EvaluateRequest

Prompt = Union[StrictStr, list[StrictInt]]
# how a bound is named in its messages: the `kvwire serve` flag where there is one
FLAGS = {"capture_values": "--max-capture-values", "patch_rows": "--max-patch-rows",
         "eval_strengths": "--max-eval-strengths", "eval_examples": "--max-eval-examples",
         "eval_neutral_tokens": "--max-eval-neutral-tokens"}


@dataclass(frozen=True)
class AnalysisLimits:
    """What one analysis request may ask.

    Args:
        capture_values: floats a capture holds at most: prompts x longest prompt's tokens x
            (sites x layers) x width (4 bytes each; base64 adds a third).
        patch_rows: patched runs a patching request makes at most: sites x layers x positions.
        eval_strengths: strengths an evaluation measures at most (each is a row per example and
            per neutral row).
        eval_examples: A/B examples an evaluation request may carry at most.
        eval_neutral_tokens: tokens of neutral text an evaluation request may carry at most (its
            `neutral`, and its `neutral_tokens` per row).

    Example:
        >>> create_app(lm, analysis_limits=AnalysisLimits(capture_values=1 << 20, patch_rows=256,
        ...                                               eval_strengths=11))
    """

    capture_values: int = 1 << 22
    patch_rows: int = 1024
    eval_strengths: int = 41
    eval_examples: int = 256
    eval_neutral_tokens: int = 4096

    def __post_init__(self):
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive int, got {value!r}")


class CaptureRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    sites: Union[StrictStr, list[StrictStr]] = "block_out"
    layers: Union[StrictStr, list[StrictInt], None] = None
    encoding_format: Literal["base64", "float"] = "base64"


class PatchRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    clean: Prompt
    corrupted: Prompt
    answers: list[Union[StrictStr, StrictInt]]
    sites: Union[StrictStr, list[StrictStr]] = "block_out"
    layers: Union[StrictStr, list[StrictInt], None] = None
    positions: Union[list[StrictInt], None] = None
    position_map: Union[dict[str, StrictInt], list[Union[StrictInt, None]], None] = None


def install_analysis(app, served, model_name, enabled=True, limits=None):
    """Add POST /kvwire/capture, /kvwire/patch and /kvwire/evaluate to `app` over `served.lm` (see
    the module docstring); with `enabled=False` all three answer 403."""
    limits = AnalysisLimits() if limits is None else limits
    allowed = [] if enabled else [Depends(_analysis_off)]

    @app.post("/kvwire/capture", dependencies=allowed)
    async def capture(body: CaptureRequest):
        got = await asyncio.to_thread(served.exclusive, _run, _capture, served.lm, body, limits)
        return {"object": "kvwire.capture", "model": model_name, "encoding_format": body.encoding_format,
                "data": _rows(got, body.encoding_format)}

    @app.post("/kvwire/patch", dependencies=allowed)
    async def patching(body: PatchRequest):
        result = await asyncio.to_thread(served.exclusive, _run, _patch, served.lm, body, limits)
        return {"object": "kvwire.patch", "model": model_name, **result.to_dict()}

    @app.post("/kvwire/evaluate", dependencies=allowed)
    async def evaluating(body: EvaluateRequest):
        result = await asyncio.to_thread(served.exclusive, _run, _evaluate, served, body, limits)
        return {"object": "kvwire.evaluation", "model": model_name,
                "vector": body.vector if isinstance(body.vector, str) else None, **_finite(result.to_dict())}


def _analysis_off():
    raise APIError("this server does not capture activations, run activation patching or evaluate vectors "
                   "(started with --no-analysis)", code="analysis_disabled", status=403, type="permission_error")


def _run(fn, *args):
    """fn(*args) with the library's refusals as 400s naming what was sent."""
    try:
        return fn(*args)
    except RequestError as e:
        raise from_request_error(e) from None
    except (ValueError, TypeError) as e:
        raise APIError(str(e), code="invalid_value") from None


def _capture(lm, body, limits):
    rows = token_rows(lm, body.input, "input")
    _, _, reads = site_reads(lm, body.sites, body.layers)
    width = sum(_width(lm, key, read) for key, read in reads.items())
    values = len(rows) * max(len(r) for r in rows) * width
    if values > limits.capture_values:
        raise APIError(f"this capture holds {values} values ({len(rows)} prompts x {max(len(r) for r in rows)} "
                       f"tokens x {width} across {len(reads)} (site, layer) pairs); this server gives at most "
                       f"{limits.capture_values} ({FLAGS['capture_values']})", param="input",
                       code="capture_too_large")
    return read_sites(lm, rows, reads)


def _width(lm, key, read):
    """Floats per token at (site, block): a site inside a call says its own width, the others carry
    the hidden size."""
    if isinstance(read, str):
        return lm.head.weight.shape[1]
    return lm.backbone.get_submodule(read[0]).site_width(key[0])


def _patch(lm, body, limits):
    if len(body.answers) != 2:
        raise APIError(f"answers must be [correct, incorrect] (token ids or one-token texts), got "
                       f"{len(body.answers)} items", param="answers", code="invalid_value")
    position_map = body.position_map
    if isinstance(position_map, dict):
        try:
            position_map = {int(k): v for k, v in position_map.items()}
        except ValueError:
            raise APIError(f"position_map keys must be corrupted positions (ints as JSON strings), got "
                           f"{sorted(position_map)}", param="position_map", code="invalid_value") from None
    patcher = patch.Patcher(lm, body.clean, body.corrupted, body.sites, body.layers, tuple(body.answers), None,
                            position_map)
    positions = patcher.positions(body.positions)
    rows = len(patcher.sites) * len(patcher.blocks) * len(positions)
    if rows > limits.patch_rows:
        raise APIError(f"this sweep patches {rows} rows ({len(patcher.sites)} sites x {len(patcher.blocks)} layers x "
                       f"{len(positions)} positions); this server runs at most {limits.patch_rows} "
                       f"({FLAGS['patch_rows']})", param="positions", code="patch_too_large")
    return patch.sweep_with(patcher, positions)


def _evaluate(served, body, limits):
    """`kw.steer.evaluate` of the request's vector on the base model, each bound checked first."""
    lm = served.lm
    if len(body.strengths) > limits.eval_strengths:
        raise _too_many("strengths", f"{len(body.strengths)} strengths", limits.eval_strengths, "eval_strengths")
    try:
        strengths = check_strengths(body.strengths)
    except ValueError as e:
        raise APIError(str(e), param="strengths", code="invalid_value") from None
    vector = _eval_vector(served, body.vector)
    data = _eval_dataset(body, limits)
    if not 2 <= body.neutral_tokens <= limits.eval_neutral_tokens:
        raise APIError(f"neutral_tokens is {body.neutral_tokens}; expected 2 to {limits.eval_neutral_tokens} "
                       f"tokens per neutral row ({FLAGS['eval_neutral_tokens']})", param="neutral_tokens",
                       code="invalid_value")
    length(body.neutral_tokens, lm.max_context, "a row of neutral_tokens", "neutral_tokens")  # one sequence
    if body.neutral is not None:
        texts = [body.neutral] if isinstance(body.neutral, str) else body.neutral
        if not texts or not all(t.strip() for t in texts):
            raise APIError(f"neutral must be a text or a list of texts, none blank, got {body.neutral!r:.60}",
                           param="neutral", code="invalid_value")
        tokens = sum(len(lm.encode(t)) for t in texts)
        if tokens > limits.eval_neutral_tokens:
            raise _too_many("neutral", f"{tokens} tokens", limits.eval_neutral_tokens, "eval_neutral_tokens")
    try:
        operation = Operation.of(vector, when="generated" if body.generated_only else None)
        return evaluate(lm, operation, data, strengths, neutral=body.neutral, neutral_tokens=body.neutral_tokens)
    except RequestError as e:  # an example past the model's context: the library names the line
        raise APIError(str(e), param="examples" if body.examples is not None else "dataset", code=e.code) from None


def _too_many(param, got, most, limit):
    return APIError(f"{param} has {got}; this server evaluates at most {most} ({FLAGS[limit]})", param=param,
                    code="evaluation_too_large")


def _eval_vector(served, vector):
    """A served vector by name, or a `ControlVector` from an inline `EvalVector`."""
    if isinstance(vector, str):
        if vector not in served.vectors:
            raise APIError(f"no control vector named {vector!r}; loaded: {', '.join(served.names) or 'none'}",
                           param="vector", code="not_found", status=404)
        return served.vectors[vector]
    blocks, width = served.blocks(), served.lm.head.weight.shape[1]
    if vector.operation not in OPERATIONS:
        raise _bad_vector(f"vector.operation is {vector.operation!r}; expected one of {list(OPERATIONS)}")
    if vector.site not in ALL_SITES:
        raise _bad_vector(f"vector.site is {vector.site!r}; expected one of {list(ALL_SITES)}")
    if not vector.directions:
        raise _bad_vector(f"vector.directions is empty; expected {{block: vector}} for blocks {sorted(blocks)}")
    directions = {}
    for key, value in vector.directions.items():
        if not (key.isascii() and key.isdecimal() and int(key) in blocks):
            raise _bad_vector(f"vector.directions has block {key!r}; the model's blocks are {min(blocks)} to "
                              f"{max(blocks)}")
        directions[int(key)] = decode_direction(value, f"vector.directions.{key}", width, _bad_vector)
        if vector.operation != "add" and not directions[int(key)].any():
            raise _bad_vector(f"vector.directions.{key} is all zeros: it has no direction to {vector.operation}")
    return ControlVector(directions, operation=vector.operation, site=vector.site)


def _bad_vector(message):
    return APIError(message, param="vector", code="invalid_value")


def _eval_dataset(body, limits):
    """The request's A/B examples, or a shipped dataset by name (never a path: the server reads no
    files a client names)."""
    if body.examples is not None:
        if body.dataset is not None:
            raise APIError(f"give dataset or examples, not both; got dataset {body.dataset!r} and "
                           f"{len(body.examples)} examples", param="dataset", code="invalid_value")
        if len(body.examples) > limits.eval_examples:
            raise _too_many("examples", f"{len(body.examples)} examples", limits.eval_examples, "eval_examples")
        try:
            return ABDataset.from_records([e.model_dump() for e in body.examples], "examples", "examples")
        except ValueError as e:
            raise APIError(str(e), param="examples", code="invalid_value") from None
    name = "sentiment-ab" if body.dataset is None else body.dataset
    if name not in SHIPPED:
        raise APIError(f"dataset {name!r} is not a shipped dataset; expected one of {sorted(SHIPPED)}, or the A/B "
                       f"examples themselves in examples", param="dataset", code="invalid_value")
    data = shipped_dataset(name)
    if len(data) > limits.eval_examples:
        raise _too_many("dataset", f"{len(data)} examples", limits.eval_examples, "eval_examples")
    return data


def _finite(value):
    """`value` (nested dicts and lists) with every float that is not finite as None: JSON has no
    NaN or infinity (a perplexity past float range)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _rows(got: Capture, encoding):
    """One entry per prompt: its tokens and, per (site, layer), its activations without pads."""
    data = []
    for i, tokens in enumerate(got.tokens):
        entries = []
        for (site, layer), value in got.row(i).items():
            entry = {"site": site, "layer": layer, "shape": list(value.shape), "dtype": "float32"}
            if encoding == "float":
                entry["data"] = value.tolist()
            else:
                entry["data"] = base64.b64encode(value.contiguous().numpy().astype("<f4").tobytes()).decode()
            entries.append(entry)
        data.append({"index": i, "tokens": tokens, "activations": entries})
    return data
