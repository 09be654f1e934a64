"""`create_app`: the OpenAI-compatible ASGI app over kvwire's engine, and `serve` to run it."""
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from . import errors, memory
from .analysis import install_analysis
from .api_docs import install_api_docs
from .auth import APIKeys, check_keys, document_bearer
from .errors import APIError
from .handlers import Handlers
from .inline import InlineBank
from .inline_sae import FeatureBank
from .body_limit import BodyLimit
from .limits import FLAGS as LIMIT_FLAGS, Limits
from .metrics import CountRequests, Metrics, install_metrics
from .playground import install_playground
from .schemas import ChatRequest, CompletionRequest
from .vectors import ServedVectors

DEFAULT_MAX_LENGTH = 4096  # per-row timeline when not given: decode attends over all of it, so not 32k
DEFAULT_MAX_BATCH = 8
# one server-sent event (OpenAPI before 3.2 describes a stream by its events): data is a JSON chunk
# or "[DONE]"
_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def create_app(lm, model_name="kvwire", *, max_batch=None, max_length=None, control_vectors=None,
               prefix_bytes=512 << 20, playground=True, limits=None, memory_budget=None, inline_slots=None,
               inline_per_request=2, api_keys=None, cors_origins=None, playground_training=True, tool_fallback=True,
               metrics=True, decode_threads=None, sae=None, sae_slots=None, sae_per_request=4, sae_site=None,
               sae_layer=None, analysis=True, analysis_limits=None):
    """An ASGI app serving `lm` with OpenAI's API: POST /v1/chat/completions, POST /v1/completions,
    GET /v1/models, GET /health, and GET /metrics (Prometheus, `kvwire.serve.metrics`). The engine's
    thread runs while the app does (its lifespan).
    With `playground`, also the steering page at / and its JSON endpoints under /kvwire/
    (`kvwire.serve.playground`). POST /kvwire/capture and /kvwire/patch read activations and run
    activation patching (`kvwire.serve.analysis`).

    Args:
        lm: a `CausalLM` with a tokenizer (chat needs its chat template).
        model_name: the id clients pass as `model` (others are refused).
        max_batch: sequences decoding at once (default 8); more requests wait in the engine's queue.
        max_length: each sequence's prompt + completion at most (default the model's context, at
            most 4096). Rows hold keys/values for what their sequences reach (the timeline grows in
            powers of two), but max_batch x max_length must fit `memory_budget`: values given are
            refused when they cannot, defaults are lowered (see `kvwire.serve.memory`).
        control_vectors: {name: kw.ControlVector}; a request's `"steer": {name: strength}` sets each
            strength for its own sequences (absent names: 0), so differently steered requests share
            a batch.
        prefix_bytes: the prefix store's budget (a conversation's next turn reuses its keys/values).
        playground: serve the page and /kvwire/ endpoints (list, train, download vectors; graph; sweep).
            A vector trained there joins the served model (the engine swaps models once the running
            requests are done; new requests wait for that).
        limits: a `Limits` (request body bytes, prompt tokens, max_tokens, sequences waiting, wall
            time a request); default `Limits()`.
        memory_budget: bytes the caches (and the prefix store) may take; default 80% of what the
            machine and this process's cgroup have available at start-up.
        inline_slots: vectors requests may carry inline (`steer_vectors`) at once, server-wide
            (None: max_batch; 0: none); past them a 429 with Retry-After (see `kvwire.serve.inline`).
        inline_per_request: inline vectors one request may carry (more: 400).
        api_keys: keys clients must send as `Authorization: Bearer KEY` (401 without one); None: no
            key needed. /health, the playground page and the API docs stay open (`kvwire.serve.auth`).
        cors_origins: origins whose pages may call the API from a browser (CORS; None: none).
        playground_training: False: the playground's training and sweep endpoints answer 403.
        tool_fallback: chat requests with `tools` for a model whose template has no tool support use
            kvwire's convention (tools in a system message, calls as <tool_call> JSON; see
            docs/tools.md); False: such requests get a 400 naming the template.
        metrics: serve GET /metrics and record what it reports; False: neither (bench/serve_agents.py
            compares the two).
        decode_threads: torch threads for decode steps (`Engine(decode_threads=)`); None: the pool's.
        sae: an `SAE` (or its SAELens folder) whose features requests set, add to or clamp with
            `sae_features` (see `kvwire.serve.inline_sae`); None: no SAE.
        sae_slots: SAE features in use at once, server-wide (None: 2 x max_batch); requests asking
            for the same feature share a slot; past them a 429 with Retry-After.
        sae_per_request: SAE features one request may carry (more: 400).
        sae_site, sae_layer: where the SAE edits (default: its hook, as `steer_features`).
        analysis: False: /kvwire/capture, /kvwire/patch and /kvwire/evaluate answer 403.
        analysis_limits: an `AnalysisLimits` (values a capture holds, rows a patching sweep runs, an
            evaluation's strengths, examples and neutral tokens).

    Example:
        >>> app = create_app(kw.load("smollm2-135m-instruct"), "smollm2", control_vectors={"happy": vec},
        ...                  api_keys=["sk-local"], limits=Limits(max_waiting=64, request_seconds=120))
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    if lm.tokenizer is None:
        raise ValueError("the served model has no tokenizer; the API takes text")
    limits = Limits() if limits is None else limits
    if api_keys is not None:
        check_keys(api_keys)  # the middleware is built at the first request: refuse bad keys now
    if isinstance(cors_origins, str):
        raise TypeError(f"cors_origins must be a list of origins, got the str {cors_origins!r}")
    max_batch, max_length = _sizes(lm, max_batch, max_length, limits, prefix_bytes, memory_budget)
    inline_slots = max_batch if inline_slots is None else inline_slots
    if not isinstance(inline_slots, int) or inline_slots < 0:
        raise ValueError(f"inline_slots (--inline-slots) must be an int >= 0, got {inline_slots!r}")
    inline = InlineBank(lm, inline_slots, max_per_request=inline_per_request) if inline_slots else None
    features = None
    if sae is not None:  # first at its site: the named vectors and the inline bank go after it
        features = FeatureBank(lm, _sae(sae), 2 * max_batch if sae_slots is None else sae_slots, sae_per_request,
                               sae_site, sae_layer)
        lm = features.apply(lm)
    engine_options = dict(max_batch=max_batch, max_length=max_length, grow=True, decode_threads=decode_threads)
    served = ServedVectors(lm, control_vectors or {}, engine_options,
                           prefix_bytes=prefix_bytes, inline=inline)
    bridge = served.bridge
    metrics = Metrics(bridge) if metrics else None
    bridge.max_waiting, bridge.request_seconds, bridge.metrics = limits.max_waiting, limits.request_seconds, metrics
    handlers = Handlers(served.model, model_name, bridge, served.names, limits, inline, tool_fallback, features,
                        lambda: frozenset(n for n, v in served.vectors.items() if v.operation == "clamp"))
    served.listeners.append(handlers.use)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        bridge.start()
        try:
            yield
        finally:
            bridge.stop()

    app = FastAPI(title="kvwire", summary=f"OpenAI-compatible API over kvwire ({model_name})", lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # served from packaged files instead (no CDN)
    # the last added runs first: CORS (answers preflights), counting, keys, the body's size, JSON
    app.add_middleware(JSONBodies)
    app.add_middleware(BodyLimit, limit=limits.body_bytes)  # before anything reads the body
    if api_keys is not None:
        app.add_middleware(APIKeys, keys=api_keys)  # a client without a key sends no body worth reading
    if metrics is not None:
        app.add_middleware(CountRequests, metrics=metrics, routes=app.routes)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["Retry-After"])
    app.state.bridge, app.state.served, app.state.metrics, app.state.sae = bridge, served, metrics, features
    errors.install(app)
    if api_keys is not None:
        document_bearer(app)
    install_api_docs(app)
    if metrics is not None:
        install_metrics(app, metrics)
    install_analysis(app, served, model_name, enabled=analysis, limits=analysis_limits)
    if playground:
        install_playground(app, served, model_name, training=playground_training, sae=features)

    # a request with "stream": true is answered as server-sent events (the schema says both)
    streamed = {200: {"description": "the answer: JSON, or server-sent events of chunks with \"stream\": true",
                      "content": {"text/event-stream": {"schema": _EVENT}}}}

    @app.post("/v1/chat/completions", responses=streamed)
    async def chat_completions(body: ChatRequest, request: Request):
        return await handlers.chat(body, request)

    @app.post("/v1/completions", responses=streamed)
    async def completions(body: CompletionRequest, request: Request):
        return await handlers.complete(body, request)

    def card():
        return {"id": model_name, "object": "model", "created": created, "owned_by": "kvwire",
                "max_length": max_length, "control_vectors": sorted(served.names),
                "inline_vectors": None if inline is None else {"slots": inline.slots, "per_request": inline.max_per_request,
                                                               "blocks": inline.blocks, "width": inline.width},
                "sae": None if features is None else features.describe()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            raise APIError(f"model {name!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found", status=404)
        return card()

    @app.get("/health")
    async def health():
        if not bridge.alive:
            return JSONResponse({"status": "error", "error": repr(bridge.failure)}, status_code=503)
        engine = bridge.engine
        return {"status": "ok", "model": model_name, "waiting": bridge.waiting,
                "running": sum(r is not None for r in engine.rows)}

    return app


def _sae(sae):
    """An `SAE`, or one read from its SAELens folder (`SAE.load`: refusals name the folder)."""
    from ..steer.sae import SAE

    return sae if isinstance(sae, SAE) else SAE.load(sae)


def _sizes(lm, max_batch, max_length, limits, prefix_bytes, budget):
    """(max_batch, max_length) checked against the model's context, the limits and the memory."""
    context = lm.max_context
    length_given, batch_given = max_length is not None, max_batch is not None
    if max_length is None:
        max_length = DEFAULT_MAX_LENGTH if context is None else min(context, DEFAULT_MAX_LENGTH)
    elif context is not None and max_length > context:  # positions past it have no embedding or rotary range
        raise ValueError(f"max_length (--max-length) is {max_length}, more than the model's context of {context} "
                         f"tokens; expected at most {context}")
    max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
    graph = getattr(lm, "cached", None)
    if getattr(graph, "slots", None) is not None:
        max_batch, max_length = memory.plan(graph, max_batch, max_length, batch_given=batch_given,
                                            length_given=length_given, budget=budget, reserved=prefix_bytes)
    for name, value in (("prompt_tokens", limits.prompt_tokens), ("max_tokens", limits.max_tokens)):
        if value is not None and value >= max_length:  # a request needs a prompt token and a new one
            raise ValueError(f"{LIMIT_FLAGS[name]} is {value}; with max_length {max_length} (--max-length) it "
                             f"must be below {max_length}")
    return max_batch, max_length


class JSONBodies:
    """The API's POST bodies are JSON whatever Content-Type says: `curl -d` sends form encoding and
    some clients send none, and valid JSON must not be refused as "not a JSON object"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def serve(app, host="127.0.0.1", port=8000, log_level="info"):
    """Run `app` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
