"""One engine replica for scale-out (`kvwire.serve.ray_serve`): `create_app` over a model in this
process, its HTTP requests run through the app's ASGI interface, and the control vectors it loads
on demand from a folder (`VectorStore`). Nothing here imports Ray: a `Replica` runs (and is tested)
without it; Ray Serve makes it a deployment.
"""
import asyncio
import json
import logging
import time
from pathlib import Path

from .router import wanted_vectors

log = logging.getLogger("kvwire.serve")


class VectorStore:
    """Control vectors to load on demand: NAME.gguf files in `folder` (NAME a Python identifier),
    looked up afresh each time, so files added while serving are found.

    Example:
        >>> store = VectorStore("vectors"); store.has("happy") and store.load("happy")
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"vector_dir {str(folder)!r} is not a folder; expected a folder of NAME.gguf "
                             f"control vectors")
        self.names()

    def names(self):
        """The names of the folder's vectors (refused: a file whose name is not an identifier)."""
        names = sorted(p.stem for p in self.folder.glob("*.gguf"))
        for name in names:
            if not name.isidentifier():
                raise ValueError(f"{self.folder / name}.gguf: a vector's file name is its name in \"steer\", so it "
                                 f"must be a Python identifier, e.g. happy.gguf or formal_tone.gguf")
        return names

    def has(self, name):
        return isinstance(name, str) and name.isidentifier() and (self.folder / f"{name}.gguf").is_file()

    def load(self, name):
        from ..steer import ControlVector

        return ControlVector.load(self.folder / f"{name}.gguf")


def load_model(model):
    """The `CausalLM` a model spec names: a preset name or path (`kw.load`), or a callable's result."""
    if callable(model):
        return model()
    from ..load import load

    return load(model, progress=False)


class Replica:
    """One engine replica: `create_app` over the model in this process, its requests run through the
    app's ASGI interface (`forward`). Ray Serve's deployment class (see `serve_on_ray`)."""

    def __init__(self, name, model, model_name, vector_dir=None, threads=None, app_options=None):
        import torch

        from .app import create_app

        if threads:
            torch.set_num_threads(threads)
        self.name = name
        self.app = create_app(load_model(model), model_name, **{"playground": False, **(app_options or {})})
        self.served = self.app.state.served
        self.store = None if vector_dir is None else VectorStore(vector_dir)
        self._lifespan, self._starting, self._loading = None, asyncio.Lock(), asyncio.Lock()

    async def forward(self, method, path, query, headers, body):
        """Answer one HTTP request: yields {status, headers, replica, vectors} (the vectors it holds
        once the request's are loaded), then the body's chunks."""
        await self._start()
        head, error = None, None
        if method == "POST" and path.startswith("/v1/"):
            body, error = await self._steerable(body, headers)
        if error is not None:
            yield self._head(error.status, [(b"content-type", b"application/json")])
            yield json.dumps(error.body()).encode()
            return
        chunks = _asgi(self.app, method, path, query, headers, body)
        async for item in chunks:
            if head is None:
                head = self._head(item["status"], item.get("headers", []))
                if method == "GET" and path.startswith("/v1/models") and head["status"] == 200:
                    card = b"".join([c async for c in chunks])  # names clients may steer with: the store's too
                    yield head
                    yield self._with_loadable(card)
                    return
                yield head
            else:
                yield item

    async def check_health(self):
        """Ray Serve's health check: a replica whose engine thread stopped is restarted."""
        bridge = self.app.state.bridge
        if self._lifespan is not None and not bridge.alive:
            raise RuntimeError(f"replica {self.name}: the engine thread stopped ({bridge.failure!r})")

    async def close(self):
        """End the app's lifespan (the engine thread stops); for a replica run outside Ray Serve."""
        if self._lifespan is not None:
            await self._lifespan.stop()
            self._lifespan = None

    async def _start(self):
        async with self._starting:  # the app's lifespan starts the engine thread, once
            if self._lifespan is None:
                lifespan = _Lifespan(self.app)
                await lifespan.start()
                self._lifespan = lifespan

    def _head(self, status, headers):
        return {"status": status, "headers": [(bytes(k), bytes(v)) for k, v in headers], "replica": self.name,
                "vectors": sorted(self.served.names)}

    async def _steerable(self, body, headers):
        """(body, None) once the store's vectors the body steers with are loaded; names at strength
        0 are dropped from it instead (0 is no steering: nothing to load). (body, APIError) when a
        vector cannot be loaded. A name in neither, or a request the app will refuse its key, is
        left for the app to answer (nothing is loaded for a client without a key)."""
        from .errors import APIError

        try:
            data = json.loads(body)
        except ValueError:
            return body, None
        steer = data.get("steer") if isinstance(data, dict) else None
        if self.store is None or not isinstance(steer, dict):
            return body, None
        absent = [name for name in steer if name not in self.served.vectors and self.store.has(name)]
        wanted = wanted_vectors(data)
        load = [name for name in absent if name in wanted]
        if load and not await self._admitted(headers):
            return body, None
        try:
            await self._load(load)
        except (ValueError, TypeError, OSError, APIError) as e:
            message = getattr(e, "message", str(e))
            return body, APIError(f"replica {self.name} could not load a control vector from the vector store: "
                                  f"{message}", param="steer", code="vector_load_failed", status=500,
                                  type="server_error")
        # a name that asks for no steering need not be loaded; a malformed value stays for the app to refuse
        idle = [name for name in absent if name not in wanted and _no_steering(steer[name])]
        if idle:
            data["steer"] = {name: value for name, value in steer.items() if name not in idle}
            body = json.dumps(data).encode()
        return body, None

    async def _admitted(self, headers):
        """Whether the app takes requests with these headers (its API keys): GET /v1/models with them."""
        status = None
        async for item in _asgi(self.app, "GET", "/v1/models", b"", headers, b""):
            status = item["status"] if status is None else status
        return status not in (None, 401)

    async def _load(self, names):
        async with self._loading:  # two requests asking for one new vector load it once
            for name in names:
                if name not in self.served.vectors:
                    started = time.perf_counter()
                    vector = await asyncio.to_thread(self.store.load, name)
                    await self.served.add(name, vector)
                    log.info("replica %s loaded control vector %r in %.2f s", self.name, name,
                             time.perf_counter() - started)

    def _with_loadable(self, card):
        """GET /v1/models's answer with `control_vectors` naming the store's vectors too."""
        data = json.loads(card)
        loadable = sorted(set(self.served.names) | set(self.store.names() if self.store else ()))
        for entry in data.get("data", [data]):
            entry["control_vectors"] = loadable
        return json.dumps(data).encode()


async def _asgi(app, method, path, query, headers, body):
    """Run one HTTP request through ASGI `app` in this process: yields the response-start message,
    then the body's chunks. Closing the generator early tells the app its client went away."""
    messages, gone = asyncio.Queue(), asyncio.Event()
    received = False

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query, "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    _running.add(task)
    task.add_done_callback(_running.discard)
    try:
        while True:
            message = await messages.get()
            if message is None:
                task.result()  # the app's error, if it raised
                raise RuntimeError(f"{method} {path}: the app ended without a complete response")
            if message["type"] == "http.response.start":
                yield message
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # after a complete answer this only ends the app's wait for a disconnect


_running = set()  # apps' request tasks (the event loop keeps only weak references)


class _Lifespan:
    """An ASGI app's lifespan (its startup, here: the engine thread) run without a web server."""

    def __init__(self, app):
        self.app, self._events, self._replies, self._task = app, asyncio.Queue(), asyncio.Queue(), None

    async def start(self):
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._events.get, self._replies.put))
        await self._events.put({"type": "lifespan.startup"})
        reply = await self._replies.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {reply.get('message')}")

    async def stop(self):
        await self._events.put({"type": "lifespan.shutdown"})
        await self._replies.get()
        await self._task


def _no_steering(value):
    """Whether a `steer` value asks for nothing: strength 0, or a clamp with neither bound."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, dict) and set(value) <= {"lo", "hi"} and all(value.get(k) is None for k in ("lo", "hi"))
