"""kvwire's server on Ray Serve: replicas of one model behind a steering-aware router.

    >>> url = serve_on_ray("smollm2-135m-instruct", replicas=2, vector_dir="vectors/")
    >>> ...   # OpenAI clients talk to f"{url}/v1"; "steer": {"happy": 1.0} loads vectors/happy.gguf
    >>> shutdown()

Each replica is a Ray Serve deployment (of one replica) running `create_app` in its own process:
its own engine thread, prefix store and steered model. Requests reach the replica's ASGI app
directly and come back chunk by chunk, so streams stay streams. An ingress deployment takes the
HTTP requests from Serve's proxy, asks a `SteeringRouter` which replica should answer and forwards
them: POST /v1/chat/completions and /v1/completions (streaming included), GET /v1/models;
GET /health asks every replica, GET /kvwire/router shows the router's view. One deployment per
replica, rather than one deployment of N replicas, because the router picks a particular replica,
which a deployment's handle does not let its caller do.

A replica lacking a vector that a request steers with loads it from `vector_dir` (NAME.gguf, read
by `ControlVector.load`) through `ServedVectors.add`, the path a vector trained in the playground
takes (`kvwire.serve.replica`). Ray, the web framework and the model code are imported when used:
the command line reads `add_arguments` without them.
"""
import asyncio
import json
import logging
import os
import sys
import time

from .replica import Replica, VectorStore
from .router import SteeringRouter, prefix_keys, wanted_vectors

log = logging.getLogger("kvwire.serve")
APP = "kvwire"
# requests a deployment takes at once; the engine queues its own (Serve's default of 5 would
# queue them in front of the engine, where batching cannot see them)
MAX_ONGOING = 1024
_DROPPED = {"content-length", "transfer-encoding", "connection"}  # the ingress streams; its server sets these
_owned = None  # "local": serve_on_ray started this Ray instance; "joined": it connected to a cluster


def serve_on_ray(model, replicas=2, *, host="127.0.0.1", port=8000, vector_dir=None, model_name=None,
                 address="local", threads=None, max_skew=4, actor_options=None, **create_app_kwargs):
    """Serve `model` as `replicas` engine replicas on Ray Serve behind a steering-aware router, and
    return the server's URL once every replica is ready (the server runs until `shutdown()`).

    Args:
        model: a preset name ("smollm2-135m-instruct") or a path, as `kw.load` takes, or a callable
            with no arguments returning the `CausalLM` (each replica calls it; Ray pickles it with
            cloudpickle, and the modules it names must import where the replicas run).
        replicas: engine replicas (each a process with a copy of the model).
        host: the address Serve's HTTP proxy listens on.
        port: its port.
        vector_dir: a folder of NAME.gguf control vectors a replica loads when a request steers
            with NAME (read at each lookup: files added later are found). None: only the
            `control_vectors` every replica starts with.
        model_name: the id clients pass as `model` (default: `model` when it is a name or path).
        address: "local" starts a Ray instance on this machine only (no dashboard, usage stats
            off); "auto" or "HOST:PORT" joins a running cluster (`ray start --head`).
        threads: torch threads per replica (default: with "local", this machine's cores shared
            among the replicas; on a cluster, torch's default).
        max_skew: how many more in-flight requests a replica holding the request's vectors or its
            conversation may have than the least loaded one and still get it (`SteeringRouter`).
        actor_options: extra Ray actor options of each replica, e.g. {"num_gpus": 1}.
        **create_app_kwargs: `create_app`'s options for every replica (max_batch, max_length,
            control_vectors, limits, ...); `playground` defaults to False (the router does not
            forward the page, and a vector trained on one replica would be unknown to the others).

    Example:
        >>> url = serve_on_ray("smollm2-135m-instruct", 2, vector_dir="vectors", max_batch=8)
        >>> shutdown()
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas (--replicas) must be an int >= 1, got {replicas!r}")
    if not callable(model) and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name, a path or a callable returning a CausalLM, got "
                        f"{type(model).__name__}")
    if vector_dir is not None:
        vector_dir = str(VectorStore(vector_dir).folder.resolve())  # refused here, before Ray starts
    model_name = (str(model) if not callable(model) else "kvwire") if model_name is None else model_name
    vectors = sorted(create_app_kwargs.get("control_vectors") or {})
    _start_ray(address, replicas)
    if threads is None and address == "local":
        threads = max(1, (os.cpu_count() or 1) // replicas)
    from ray import serve

    names = [f"replica_{i}" for i in range(replicas)]
    replica = serve.deployment(Replica, num_replicas=1, max_ongoing_requests=MAX_ONGOING,
                               ray_actor_options={"num_cpus": 1, **(actor_options or {})})
    handles = {name: replica.options(name=f"kvwire_{name}").bind(name, model, model_name, vector_dir, threads,
                                                                   create_app_kwargs) for name in names}
    ingress = serve.deployment(Ingress, name="kvwire_router", num_replicas=1, max_ongoing_requests=MAX_ONGOING,
                               ray_actor_options={"num_cpus": 0})
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(ingress.bind(handles, vectors, model_name, max_skew), name=APP, route_prefix="/")
    except BaseException:  # a replica that cannot start (its model, its options): leave nothing running
        shutdown()
        raise
    return f"http://{host}:{port}"


def shutdown():
    """Stop what `serve_on_ray` started: Serve and the local Ray instance; on a cluster it joined,
    its application only (the cluster and other applications run on). Does nothing when nothing runs."""
    global _owned
    if _owned is None or "ray" not in sys.modules:
        return
    import ray
    from ray import serve

    if ray.is_initialized():
        if _owned == "local":
            serve.shutdown()
        else:
            serve.delete(APP)
        ray.shutdown()
    _owned = None


def add_arguments(parser):
    """The scale-out flags on a command (`kvwire serve --ray --replicas N`)."""
    group = parser.add_argument_group("scale-out on Ray Serve (pip install 'ray[serve]')")
    group.add_argument("--ray", action="store_true",
                       help="serve --replicas copies of the model on Ray Serve behind a router that sends a request "
                       "to a replica holding its control vectors and its conversation's prefix")
    group.add_argument("--replicas", type=int, default=2, metavar="N", help="engine replicas (default %(default)s)")
    group.add_argument("--vector-dir", default=None, metavar="FOLDER",
                       help="NAME.gguf control vectors a replica loads when a request steers with NAME")
    group.add_argument("--ray-address", default="local", metavar="ADDRESS",
                       help="'local' (default): a Ray instance on this machine only; 'auto' or HOST:PORT: join a "
                       "running cluster (ray start --head)")


def run_from_args(args, lm_loader, **create_app_kwargs):
    """Run `kvwire serve --ray` until interrupted: `serve_on_ray` with the command's options.

    Args:
        args: the parsed `kvwire serve` options, with `add_arguments`' (host, port, model too).
        lm_loader: a callable with no arguments returning the model, called in every replica; Ray
            pickles it (e.g. `functools.partial(load_model, args, args.quantize)`).
        **create_app_kwargs: what the command gives `create_app` (control_vectors, max_batch,
            limits, api_keys, ...), for every replica.

    Example:
        >>> run_from_args(args, partial(load_model, args, args.quantize), control_vectors=vectors, max_batch=8)
    """
    url = serve_on_ray(lm_loader, args.replicas, host=args.host, port=args.port, vector_dir=args.vector_dir,
                       model_name=args.model, address=args.ray_address, **create_app_kwargs)
    print(f"serving {args.model} on {url}/v1 with {args.replicas} replicas on Ray Serve (vectors loaded on demand "
          f"from {args.vector_dir or 'nowhere'}); router state: {url}/kvwire/router", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def _start_ray(address, replicas):
    global _owned
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # read when ray is imported: no report leaves the machine
    import ray

    if ray.is_initialized():
        _owned = _owned or "joined"
        return
    if address == "local":
        ray.init(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, replicas))
    else:
        ray.init(address=address)
    _owned = "local" if address == "local" else "joined"


class Ingress:
    """The HTTP front of `serve_on_ray`: routes each request to a replica (`SteeringRouter`) and
    streams its answer back. Ray Serve's deployment class, called with each HTTP request.

    Args:
        replicas: {replica id: Ray Serve handle of its `Replica` deployment}.
        vectors: names every replica starts with. model_name: the served model's id.
    """

    def __init__(self, replicas, vectors, model_name, max_skew=4):
        self.handles, self.model_name = dict(replicas), model_name
        self.router = SteeringRouter(list(self.handles), vectors=vectors, max_skew=max_skew)

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        from .errors import APIError

        path, method = request.url.path, request.method
        if path == "/health" and method == "GET":
            return await self._health()
        if path == "/kvwire/router" and method == "GET":
            return JSONResponse({"model": self.model_name, "replicas": self.router.state()})
        if path.startswith("/v1/"):
            return await self._forward(request)
        return APIError(f"no route {method} {path} here; the API is under /v1/ (and GET /health, "
                        f"/kvwire/router)", code="not_found", status=404).response()

    async def _forward(self, request):
        """Route a POST (a generation) through the router; a GET (the model card) goes to the least
        loaded replica without counting as a request routed."""
        from starlette.responses import StreamingResponse

        from .errors import APIError

        body = await request.body()
        route = None
        if request.method == "POST":
            data = _json(body)
            route = self.router.route(wanted_vectors(data), prefix_keys(data))
        replica = self.router.least_loaded() if route is None else route.replica
        headers = [(k.lower(), v) for k, v in request.headers.raw]
        call = self.handles[replica].options(stream=True).forward.remote(
            request.method, request.url.path, request.url.query.encode(), headers, body)
        try:
            head = await call.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or failed: the client gets a 503
            if route is not None:
                self.router.finish(replica)
            log.exception("replica %s failed a request", replica)
            return APIError(f"replica {replica} could not answer ({type(e).__name__}: {e})", status=503,
                            type="server_error", code="replica_unavailable").response()
        if route is not None:
            self.router.observe(route, head["vectors"])

        async def rest():
            try:
                async for chunk in call:
                    yield chunk
            finally:
                if route is not None:
                    self.router.finish(replica)
                call.cancel()  # the client went away mid-stream: the replica's sequences stop too

        answer = {k.decode("latin-1"): v.decode("latin-1") for k, v in head["headers"]
                  if k.decode("latin-1").lower() not in _DROPPED}
        answer["x-kvwire-replica"] = replica  # who answered, and what it held when it took the request
        answer["x-kvwire-vectors"] = ",".join(head["vectors"])
        return StreamingResponse(rest(), status_code=head["status"], headers=answer)

    async def _health(self):
        """200 when every replica's engine runs; each replica's own answer under "replicas"."""
        from starlette.responses import JSONResponse

        async def one(name, handle):
            try:
                call = handle.options(stream=True).forward.remote("GET", "/health", b"", [], b"")
                head = await asyncio.wait_for(call.__anext__(), 30)
                return name, head["status"], json.loads(b"".join([chunk async for chunk in call]))
            except Exception as e:  # noqa: BLE001 - a dead or stuck replica is what /health reports
                return name, 503, {"status": "error", "error": f"{type(e).__name__}: {e}"}

        answers = await asyncio.gather(*(one(name, handle) for name, handle in self.handles.items()))
        ok = all(status == 200 for _, status, _ in answers)
        return JSONResponse({"status": "ok" if ok else "error", "model": self.model_name,
                             "waiting": sum(a.get("waiting", 0) for _, _, a in answers),
                             "running": sum(a.get("running", 0) for _, _, a in answers),
                             "replicas": {name: a for name, _, a in answers}}, status_code=200 if ok else 503)


def _json(body):
    try:
        return json.loads(body)
    except ValueError:
        return None  # the replica's app refuses it with the proper message
