"""The steering playground: the page at / (plain files in kvwire/serve/static/, no build step, no
network) and kvwire's own JSON endpoints under /kvwire/ that it uses:

    GET  /kvwire/info                 model, context, blocks, training methods (and the default), vectors, SAE,
                                      the shipped A/B datasets (the evaluation panel's choices)
    GET  /kvwire/vectors              the loaded control vectors
    GET  /kvwire/vectors/NAME.gguf    one of them as a llama.cpp control-vector GGUF
    POST /kvwire/train                {name, positive, negative, layers?, method?, site?, operation?} -> a job (202)
    GET  /kvwire/jobs/ID              the job's state: queued/training/installing/done/error
    GET  /kvwire/graph                {svg, steer_nodes}: kw.plot of the served backbone
    POST /kvwire/sweep                {vector, strengths, prompt?, ...} -> kw.steer.sweep's data

The page's Evaluate tab posts to /kvwire/evaluate, an analysis endpoint (`kvwire.serve.analysis`;
`--no-analysis` turns it off, and the tab then shows the 403's message).

With `training=False` (`kvwire serve --no-playground-training`) /kvwire/train and /kvwire/sweep
answer 403: the page still lists, draws and hands out the vectors the server was started with, but
no client can make the server train (minutes of CPU, the engine paused) or sweep.

Training, a sweep and drawing the graph run off the event loop with the engine paused between
steps (`EngineThread.gate`: torch.fx tracing must not overlap a forward on another thread).
Errors have OpenAI's shape ({"error": {"message", ...}}), as the API's, so the page shows
`error.message`."""
import asyncio
import logging
import tempfile
import time
import uuid
from pathlib import Path

from fastapi import Depends, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt
from typing import Union

from ..generate.request import RequestError
from ..steer import ControlVector
from ..layers.site import ALL_SITES as SITES
from ..steer.dataset import SHIPPED as DATASETS
from ..steer.vector import DEFAULT_METHOD, METHODS, _check_pairs, parse_layers
from .errors import APIError, from_request_error

log = logging.getLogger("kvwire.serve")
STATIC = Path(__file__).parent / "static"
Number = Union[StrictInt, StrictFloat]
MAX_SWEEP = 41  # strengths in one sweep request
MAX_PROMPTS = 4096  # training prompts per side in one request



class TrainRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    positive: list[str]
    negative: list[str]
    layers: str | list[StrictInt] | None = None
    method: str = DEFAULT_METHOD
    site: str = "block_out"
    operation: str = "add"


OPERATIONS = ("add", "ablate", "clamp")  # what a served vector does; requests give strengths, or a clamp's bounds


class SweepRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    vector: str
    strengths: list[Number]
    prompt: str | None = None
    max_tokens: StrictInt = 24
    positive_words: list[str] | None = None
    negative_words: list[str] | None = None
    probe_prompts: list[str] | None = None


class Jobs:
    """Training jobs, one at a time (they share the CPU with serving): {id: state dict}."""

    def __init__(self, served):
        self.served, self.jobs, self.running = served, {}, None

    def start(self, body):
        self._check(body)
        if self.running is not None:
            raise APIError(f"a vector is already training (job {self.running}); wait for it to finish",
                           code="busy", status=409)
        job = {"id": uuid.uuid4().hex[:12], "name": body.name, "state": "queued", "pairs": len(body.positive),
               "message": f"training {body.name!r} on {len(body.positive)} pairs", "error": None,
               "started": time.time(), "seconds": 0.0, "vector": None}
        self.jobs[job["id"]], self.running = job, job["id"]
        asyncio.get_running_loop().create_task(self._run(job, body))
        return job

    def _check(self, body):
        """What can be refused before training (the page shows these at once)."""
        self.served.check_new_name(body.name)
        for side in ("positive", "negative"):
            if len(getattr(body, side)) > MAX_PROMPTS:
                raise APIError(f"{side} has {len(getattr(body, side))} prompts; at most {MAX_PROMPTS}",
                               param=side, code="invalid_value")
        try:
            _check_pairs(body.positive, body.negative)
        except ValueError as e:
            raise APIError(str(e), param="positive", code="invalid_value") from None
        if body.site not in SITES:
            raise APIError(f"site must be one of {list(SITES)}, got {body.site!r}", param="site", code="invalid_value")
        if body.operation not in OPERATIONS:
            raise APIError(f"operation must be one of {list(OPERATIONS)}, got {body.operation!r}", param="operation",
                           code="invalid_value")
        if body.method not in METHODS:
            raise APIError(f"method must be one of {list(METHODS)}, got {body.method!r}", param="method",
                           code="invalid_value")
        try:
            parse_layers(body.layers or None, self.served.blocks())
        except ValueError as e:
            raise APIError(str(e), param="layers", code="invalid_value") from None

    async def _run(self, job, body):
        try:
            job.update(state="training", message=f"reading hidden states of {2 * len(body.positive)} prompts")
            vector = await asyncio.to_thread(self.served.exclusive, ControlVector.train, self.served.lm,
                                             body.positive, body.negative, layers=body.layers or None,
                                             method=body.method, progress=False, site=body.site,
                                             operation=body.operation)
            job.update(state="installing", message="building the steered model")
            await self.served.add(body.name, vector)
            job.update(state="done", message=f"{body.name!r} is ready", vector=self.served.describe(body.name))
        except (ValueError, TypeError, APIError, RuntimeError) as e:
            job.update(state="error", error=getattr(e, "message", str(e)), message="training failed")
        except Exception as e:  # noqa: BLE001 - a bug: the job says so, the server goes on
            log.exception("training job %s failed", job["id"])
            job.update(state="error", error=f"{type(e).__name__}: {e}", message="training failed")
        finally:
            job["seconds"] = round(time.time() - job["started"], 2)
            self.running = None

    def get(self, job_id):
        if job_id not in self.jobs:
            raise APIError(f"no training job {job_id!r}", code="not_found", status=404)
        job = dict(self.jobs[job_id])
        if job["state"] not in ("done", "error"):
            job["seconds"] = round(time.time() - job["started"], 2)
        return job


def install_playground(app, served, model_name, training=True, sae=None):
    """Add the page and the /kvwire/ endpoints to `app` (see the module docstring); with
    `training=False` the training and sweep endpoints answer 403. `sae`: the server's
    `FeatureBank` (the page then offers SAE features), or None."""
    jobs = Jobs(served)
    # a dependency runs before the body is read and checked: refused is refused, whatever was sent
    allowed = [] if training else [Depends(_training_off)]
    graphs = {}  # served.version -> the graph's answer (drawing takes dot a moment)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/kvwire/info")
    async def info():
        return {"model": model_name, "max_length": served.max_length, "blocks": sorted(served.blocks()),
                "methods": list(METHODS), "default_method": DEFAULT_METHOD, "sites": list(SITES),
                "operations": list(OPERATIONS), "training": training,
                "sae": None if sae is None else sae.describe(), "datasets": sorted(DATASETS),
                "vectors": [served.describe(n) for n in served.names], "version": served.version}

    @app.get("/kvwire/vectors")
    async def vectors():
        return {"data": [served.describe(n) for n in served.names]}

    @app.get("/kvwire/vectors/{file}", response_class=Response, responses={200: {
        "description": "the control vector as a llama.cpp GGUF file",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def download(file: str):
        name = file[:-len(".gguf")] if file.endswith(".gguf") else file
        if name not in served.vectors:
            raise APIError(f"no control vector named {name!r}; loaded: {', '.join(served.names) or 'none'}",
                           code="not_found", status=404)
        data = await asyncio.to_thread(_gguf_bytes, served.vectors[name])
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{name}.gguf"'})

    @app.post("/kvwire/train", status_code=202, dependencies=allowed)
    async def train(body: TrainRequest):
        return jobs.start(body)

    @app.get("/kvwire/jobs/{job_id}")
    async def job(job_id: str):
        return jobs.get(job_id)

    @app.get("/kvwire/graph")
    async def graph():
        version, model = served.version, served.model  # a vector added while drawing is the next version
        if version not in graphs:
            svg = await asyncio.to_thread(served.exclusive, _graph_svg, model)
            graphs.clear()
            graphs[version] = {"svg": svg, "steer_nodes": served.steer_nodes(model), "version": version}
        return graphs[version]

    @app.post("/kvwire/sweep", dependencies=allowed)
    async def sweep(body: SweepRequest):
        return JSONResponse(await asyncio.to_thread(served.exclusive, _sweep, served, body))


def _training_off():
    raise APIError("this server does not train vectors or run sweeps (started with --no-playground-training); "
                   "listing, drawing and downloading its vectors still work", code="training_disabled", status=403,
                   type="permission_error")


def _gguf_bytes(vector):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "vector.gguf"
        try:
            vector.save(path)
        except ValueError as e:
            raise APIError(str(e), code="unsupported") from None
        return path.read_bytes()


def _graph_svg(model):
    from ..graph import plot

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.svg"
        try:
            plot(model.backbone, path)
        except (RuntimeError, ImportError) as e:  # no Graphviz `dot` (or no graphviz package)
            raise APIError(f"cannot draw the graph: {e}", code="no_graphviz", status=503,
                           type="server_error") from None
        return path.read_text(encoding="utf-8")


def _sweep(served, body):
    from ..steer.sweep import WordGap, sweep

    if body.vector not in served.vectors:
        raise APIError(f"no control vector named {body.vector!r}; loaded: {', '.join(served.names) or 'none'}",
                       param="vector", code="not_found", status=404)
    if not 1 <= len(body.strengths) <= MAX_SWEEP:
        raise APIError(f"strengths must list 1 to {MAX_SWEEP} numbers, got {len(body.strengths)}",
                       param="strengths", code="invalid_value")
    if not 1 <= body.max_tokens <= 256:
        raise APIError(f"max_tokens must lie in [1, 256], got {body.max_tokens}", param="max_tokens",
                       code="invalid_value")
    words = {k: v for k, v in dict(positive=body.positive_words, negative=body.negative_words,
                                   prompts=body.probe_prompts).items() if v is not None}
    options = {} if body.prompt is None else {"prompt": body.prompt}
    try:
        result = sweep(served.lm, served.vectors[body.vector], body.strengths, probe=WordGap(**words),
                       max_new_tokens=body.max_tokens, **options)
    except RequestError as e:
        raise from_request_error(e) from None
    except ValueError as e:
        raise APIError(str(e), code="invalid_value") from None
    return {"vector": body.vector, **result.to_dict()}
