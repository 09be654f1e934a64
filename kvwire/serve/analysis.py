"""kvwire's analysis endpoints: activations at named sites and activation patching, over the served
(unsteered) model.

    POST /kvwire/capture  {input, sites?, layers?, encoding_format?} -> each prompt's activations
    POST /kvwire/patch    {clean, corrupted, answers, sites?, layers?, positions?, position_map?}
                          -> logit difference and fraction recovered per (site, layer, position)

Activations come as base64 of little-endian float32 with their shape (`encoding_format` "base64",
the default) or as nested JSON lists ("float"), as OpenAI's embeddings do. What one request may ask
is bounded (`AnalysisLimits`: values a capture holds, rows a patching sweep runs); past a bound, a
400 names it. With `enabled=False` (`kvwire serve --no-analysis`) both answer 403.

They run off the event loop with the engine paused (`ServedVectors.exclusive`: they trace the
graph, which must not overlap a forward on the engine's thread).
"""
import asyncio
import base64
from dataclasses import dataclass
from typing import Literal, Union

from fastapi import Depends
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from ..generate.request import RequestError
from ..steer import patch
from ..steer.capture import Capture, read_sites, site_reads, token_rows
from .errors import APIError, from_request_error

Prompt = Union[StrictStr, list[StrictInt]]
FLAGS = {"capture_values": "--max-capture-values", "patch_rows": "--max-patch-rows"}


@dataclass(frozen=True)
class AnalysisLimits:
    """What one analysis request may ask.

    Args:
        capture_values: floats a capture holds at most: prompts x longest prompt's tokens x
            (sites x layers) x width (4 bytes each; base64 adds a third).
        patch_rows: patched runs a patching request makes at most: sites x layers x positions.

    Example:
        >>> create_app(lm, analysis_limits=AnalysisLimits(capture_values=1 << 20, patch_rows=256))
    """

    capture_values: int = 1 << 22
    patch_rows: int = 1024

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
    """Add POST /kvwire/capture and /kvwire/patch to `app` over `served.lm` (see the module
    docstring); with `enabled=False` both answer 403."""
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


def _analysis_off():
    raise APIError("this server does not capture activations or run activation patching (started with "
                   "--no-analysis)", code="analysis_disabled", status=403, type="permission_error")


def _run(fn, lm, body, limits):
    """fn(lm, body, limits) with the library's refusals as 400s naming what was sent."""
    try:
        return fn(lm, body, limits)
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
