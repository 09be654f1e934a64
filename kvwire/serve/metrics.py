"""`GET /metrics`: the server's counters in Prometheus' text format, on a registry of its own per app
(tests and embedders create many apps in one process; the global registry would mix them).

What is recorded, and where: each HTTP answer's status as it starts (`CountRequests`, middleware);
each generation request's sequences once they are over (`Metrics.record`, called by the bridge's
`Run.updates` on the event loop: a few increments per request, nothing per token on the engine
thread); the queue, the busy rows and the compiled steps being built read when scraped.
"""
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response
from starlette.routing import Match

from ..generate.background import building
from ..steer.ops import LIMIT

# seconds; a first token waits for the prompt's prefill (and the queue), a later one for one decode step
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}  # others share one label value
# a steering input's inert value, by its name's suffix: strengths of named and inline vectors, an
# SAE feature's added value, the bounds of clamps (named, inline) and of SAE features
INERT = {"strength": 0.0, "add": 0.0, "lo": -LIMIT, "hi": LIMIT}


class Metrics:
    """The app's Prometheus metrics (names start with `kvwire_`), on `self.registry`.

    Args:
        bridge: the `EngineThread` whose engine the queue and row gauges read when scraped (None: no
            gauges).

    Example:
        >>> metrics = Metrics(bridge)
        >>> bridge.metrics = metrics                       # it records each request's sequences
        >>> metrics.record_response("/v1/models", "GET", 200)
        >>> text = metrics.exposition().decode()           # what GET /metrics answers
    """

    def __init__(self, bridge=None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvwire_http_requests", "HTTP requests answered, by endpoint (route path), method "
                                "and status", ["endpoint", "method", "status"], registry=r)
        self.prompt_tokens = Counter("kvwire_prompt_tokens", "prompt tokens of finished requests (n choices of "
                                     "one prompt count it once, as usage.prompt_tokens)", registry=r)
        self.generated_tokens = Counter("kvwire_generation_tokens", "tokens generated (usage.completion_tokens)",
                                        registry=r)
        self.cached_tokens = Counter("kvwire_prefix_cache_hit_tokens", "prompt tokens restored from the prefix "
                                     "store (usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.steered = Counter("kvwire_steered_requests", "generation requests that steer: a control vector's "
                               "strength (served or inline) nonzero, a clamp's bound (served or inline) given, or "
                               "an SAE feature set, added to or clamped", registry=r)
        self.generation_requests = Counter("kvwire_generation_requests", "generation requests over, by how their "
                                           "sequences ended (several: joined by +; timeout: --request-timeout)",
                                           ["finish_reason"], registry=r)
        self.first_token = Histogram("kvwire_time_to_first_token_seconds", "per sequence: from its submission to "
                                     "the engine (the prompt tokenised) to its first token", registry=r,
                                     buckets=FIRST_TOKEN_BUCKETS)
        self.per_token = Histogram("kvwire_time_per_output_token_seconds", "per sequence: the mean time between "
                                   "its tokens after the first", registry=r, buckets=PER_TOKEN_BUCKETS)
        if bridge is not None:
            r.register(_EngineGauges(bridge))

    def record(self, seqs, firsts=None, timed_out=False):
        """Count one request's sequences, when it is over (sequences not done, cancelled or timed
        out, count what they made). `firsts`: the indices of the sequences that start a prompt (n
        choices of one prompt count its tokens once, as usage does; None: every sequence).
        `timed_out`: the request ran past --request-timeout (its finish_reason label: "timeout")."""
        if not seqs:
            return
        prompts = seqs if firsts is None else [seqs[i] for i in firsts]
        self.prompt_tokens.inc(sum(len(s.prompt) for s in prompts))
        self.cached_tokens.inc(sum(s.cached_tokens for s in prompts))
        self.generated_tokens.inc(sum(len(s.tokens) for s in seqs))
        reasons = ["timeout"] if timed_out else sorted({s.finish_reason or "cancelled" for s in seqs})
        self.generation_requests.labels("+".join(reasons)).inc()
        if any(steers(s.inputs) for s in seqs):
            self.steered.inc()
        for s in seqs:
            if s.first_token_at is not None:
                self.first_token.observe(s.first_token_at - s.submitted)
                if s.finished_at is not None and s.steps > 1:  # steps: tokens sampled, a stop token included
                    self.per_token.observe((s.finished_at - s.first_token_at) / (s.steps - 1))

    def record_response(self, endpoint, method, status):
        self.requests.labels(endpoint, method if method in METHODS else "other", str(status)).inc()

    def exposition(self):
        """The registry in Prometheus' text format (bytes)."""
        return generate_latest(self.registry)


def steers(inputs):
    """Whether a sequence's runtime inputs ({name: number}) steer it: any steering input away from
    its inert value (`INERT`, by the name's suffix).

    Example:
        >>> steers({"happy_strength": 0.0, "calm_lo": -1.0, "calm_hi": LIMIT})   # a clamp bound given
        True
    """
    return any(v != INERT.get(k.rsplit("_", 1)[-1], v) for k, v in inputs.items())


class _EngineGauges:
    """Gauges read from the served engine when scraped (the engine may be swapped meanwhile)."""

    def __init__(self, bridge):
        self.bridge = bridge

    def describe(self):
        return list(self._families(0, 0, 0, 0.0, 0, 0))

    def collect(self):
        engine = self.bridge.engine
        running = sum(r is not None for r in engine.rows)
        return list(self._families(self.bridge.waiting, running, engine.capacity, engine.mask_seconds,
                                   engine.decode_steps, building()))

    @staticmethod
    def _families(waiting, running, rows, mask_seconds, steps, builds):
        yield GaugeMetricFamily("kvwire_requests_waiting", "sequences waiting for a row", value=waiting)
        yield GaugeMetricFamily("kvwire_rows_running", "rows holding a sequence (prefilling or decoding)",
                                value=running)
        yield GaugeMetricFamily("kvwire_rows", "rows of the engine (--max-batch)", value=rows)
        yield GaugeMetricFamily("kvwire_compiled_steps_building", "compiled steps (--compile) child processes are "
                                "building or have queued; their call shapes run eager until built", value=builds)
        # the engine's own totals (a served model swapped for one with a new vector starts them afresh)
        yield CounterMetricFamily("kvwire_constraint_mask_seconds", "seconds spent masking constrained rows' "
                                  "logits (response_format, forced tool calls)", value=mask_seconds)
        yield CounterMetricFamily("kvwire_decode_steps", "decode steps of the engine", value=steps)


class CountRequests:
    """ASGI middleware: counts each HTTP answer by its route's path (not the URL: /v1/models/NAME
    and /kvwire/jobs/ID stay one label each; no route: "unmatched"), method and status, when the
    answer starts (an error raised before any answer counts as 500)."""

    def __init__(self, app, metrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.record_response(self._endpoint(scope), scope["method"], message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if not started:
                self.metrics.record_response(self._endpoint(scope), scope["method"], 500)
            raise

    def _endpoint(self, scope):
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
            if match == Match.PARTIAL and partial is None:  # the path with another method: a 405
                partial = route.path
        return partial or "unmatched"


def install_metrics(app, metrics):
    """`GET /metrics` on `app` (left out of the OpenAPI schema: it is for Prometheus, not clients)."""

    @app.get("/metrics", include_in_schema=False)
    async def scrape():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
