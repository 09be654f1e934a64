"""Which replica serves a request, when several run the same model (`kvwire.serve.ray_serve`).

Two things make a replica the right one:

- It holds the request's named control vectors (`"steer": {name: strength}`, strength nonzero, or
  a clamp vector's `{name: {"lo": a, "hi": b}}`, a bound given). A replica lacking one loads it on
  demand, which rebuilds its steered model and swaps its engine (`ServedVectors.add`): its running
  requests drain first and its prefix store starts empty.
- It served an earlier turn of the conversation: its prefix store still holds those keys/values,
  so the next turn is not prefilled again.

Prefix keys. The router holds no tokenizer, so it keys conversations by their messages, not by
rendered tokens: key j is a hash chained over messages[:j] (canonical JSON of each message), for
every j, seeded with the endpoint and the request's steering: named vectors' strengths and bounds,
inline vectors, SAE features and their mode (the prefix store reuses keys/values only between
sequences run with equal steering). A stored sequence serves any prefix of itself, so
a replica that answered messages[:n] holds keys 1..n; the next turn, messages[:n] + [reply, user],
finds key n there (its messages minus the new user turn and the reply before it), and a new
conversation under a shared system prompt finds key 1. The longest key held wins, if it covers
`min_share` of the request's text (a key's reply, which the replica generated, counts as covered):
a short system prompt does not pull every new conversation onto one replica. A completion's
key is its whole prompt (a repeated prompt). Keys are remembered when a request is routed, in an
LRU of `max_prefixes` per replica; a replica that loads a vector forgets its keys (fresh store).

Load. Preference never piles work on one replica: a replica with the vectors (or the prefix) is
preferred only while it has at most `max_skew` more requests in flight than the least loaded one;
past that, the least loaded replica takes the request (and loads the vectors it lacks). Remaining
ties go to fewer in-flight requests, then fewer requests routed so far, then the replicas' order:
the same sequence of calls always gives the same routes.

No web framework or Ray here: `SteeringRouter` works on replica ids and is tested with fakes.
"""
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

MAX_KEYS = 64  # prefix keys one request remembers: its first message and its last 63 prefixes


@dataclass(frozen=True)
class Route:
    """Where a request goes: the replica's id, the vectors it must load first (empty when it holds
    them all), and how many messages of the conversation it served before (0: none)."""

    replica: str
    load: frozenset = frozenset()
    prefix: int = 0


class SteeringRouter:
    """Picks a replica per request by steering vectors, conversation prefix and load.

    Args:
        replicas: replica ids, in the order that breaks the last ties.
        vectors: names every replica holds from the start (create_app's `control_vectors`).
        max_prefixes: prefix keys remembered per replica (least recently routed dropped first).
        max_skew: in-flight requests a replica holding the vectors or the prefix may have above the
            least loaded replica and still be preferred; None: no limit.
        min_share: the share of a request's text (its messages' JSON) a served prefix must cover to
            count: a short system prompt every conversation shares does not pull them all onto one
            replica, a conversation's earlier turns do.

    Example:
        >>> router = SteeringRouter(["r0", "r1"])
        >>> route = router.route(wanted_vectors(body), prefix_keys(body))   # Route(replica='r0', ...)
        >>> ...   # forward the request to route.replica, which loads route.load first
        >>> router.observe(route, names_the_replica_holds)   # when its answer starts
        >>> router.finish(route.replica)   # when its answer ends
    """

    def __init__(self, replicas, *, vectors=(), max_prefixes=4096, max_skew=4, min_share=0.5):
        replicas = list(replicas)
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas must be distinct ids, at least one; got {replicas!r}")
        if isinstance(max_prefixes, bool) or not isinstance(max_prefixes, int) or max_prefixes < 1:
            raise ValueError(f"max_prefixes must be an int >= 1, got {max_prefixes!r}")
        if max_skew is not None and (isinstance(max_skew, bool) or not isinstance(max_skew, int) or max_skew < 0):
            raise ValueError(f"max_skew must be an int >= 0 or None, got {max_skew!r}")
        if isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0 <= min_share <= 1:
            raise ValueError(f"min_share must be a number in [0, 1], got {min_share!r}")
        self.replicas, self.max_prefixes, self.max_skew, self.min_share = replicas, max_prefixes, max_skew, min_share
        self._order = {r: i for i, r in enumerate(replicas)}
        self._held = {r: frozenset(vectors) for r in replicas}
        self._prefixes = {r: OrderedDict() for r in replicas}  # prefix keys, least recently routed first
        self._in_flight = dict.fromkeys(replicas, 0)
        self._routed = dict.fromkeys(replicas, 0)
        self._loads = {r: [] for r in replicas}  # names each replica was sent to load, in order
        self._pending = {r: frozenset() for r in replicas}  # loads routed, not yet observed

    def route(self, wanted=frozenset(), keys=()):
        """Choose a replica for a request steering with `wanted` (vector names) whose conversation
        has prefix `keys` (`prefix_keys`, longest first), and count it in flight there until `finish`.

        Returns a `Route`; its `load` names the vectors the replica is now recorded to hold (it
        must load them before serving the request).
        """
        wanted = frozenset(wanted)
        least = min(self._in_flight.values())
        near = [r for r in self.replicas if self.max_skew is None or self._in_flight[r] <= least + self.max_skew]
        holders = [r for r in near if wanted <= self._held[r]]
        if holders:
            hits = {r: self._hit(r, keys) for r in holders}
            best = min(holders, key=lambda r: (-hits[r], self._in_flight[r], self._routed[r], self._order[r]))
            route = Route(best, frozenset(), hits[best])
        else:  # nobody near the least loaded has them: the least loaded loads what it lacks
            best = min(self.replicas, key=lambda r: (self._in_flight[r], len(wanted - self._held[r]),
                                                      len(self._held[r]), self._routed[r], self._order[r]))
            route = Route(best, wanted - self._held[best], 0)
        if route.load:
            self._held[best] |= route.load
            self._pending[best] |= route.load
            self._loads[best].extend(sorted(route.load))
            self._prefixes[best].clear()  # a new steered model gets an empty prefix store
        self._remember(best, keys)
        self._in_flight[best] += 1
        self._routed[best] += 1
        return route

    def finish(self, replica):
        """A request routed to `replica` is answered (or gave up)."""
        if self._in_flight[replica] < 1:
            raise ValueError(f"replica {replica!r} has no request in flight to finish")
        self._in_flight[replica] -= 1

    def observe(self, route, vectors):
        """What the replica of `route` said it holds once it took that request (`vectors`): its
        loads are settled (done or failed), and the router believes the replica from now on, short
        of loads still pending for other requests. A holding that differs from the router's view (a
        failed load, a restarted replica) also drops its prefix keys."""
        replica = route.replica
        self._pending[replica] -= route.load
        held = frozenset(vectors) | self._pending[replica]
        if held != self._held[replica]:
            self._prefixes[replica].clear()
        self._held[replica] = held

    def least_loaded(self):
        """The replica with the fewest requests in flight (the first of those), for what is not routed."""
        return min(self.replicas, key=lambda r: (self._in_flight[r], self._order[r]))

    def holds(self, replica):
        return self._held[replica]

    def in_flight(self, replica):
        return self._in_flight[replica]

    def state(self):
        """{replica: {vectors, in_flight, routed, loads, prefixes}} (GET /kvwire/router)."""
        return {r: {"vectors": sorted(self._held[r]), "in_flight": self._in_flight[r], "routed": self._routed[r],
                    "loads": list(self._loads[r]), "prefixes": len(self._prefixes[r])} for r in self.replicas}

    def _hit(self, replica, keys):
        """Messages covered by the longest of `keys` the replica served, if it covers `min_share` of
        the request's text (0: none)."""
        held = self._prefixes[replica]
        return next((covered for key, covered, share in keys if key in held and share >= self.min_share), 0)

    def _remember(self, replica, keys):
        held = self._prefixes[replica]
        for key, *_ in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_prefixes:
            held.popitem(last=False)


def wanted_vectors(body):
    """The control vectors a request body steers with: names in `steer` with a nonzero number, and
    clamp vectors' names with bounds {"lo": a, "hi": b}, a bound given (both left out or null is no
    steering, as strength 0). Malformed values are left for the replica to refuse."""
    return frozenset(_steering(body))


def _steering(body):
    """{name: value} of the names `wanted_vectors` gives, canonical: a strength as a float, a
    clamp's bounds as [lo, hi] (None: unbounded)."""
    steer = body.get("steer") if isinstance(body, dict) else None
    if not isinstance(steer, dict):
        return {}
    out = {}
    for name, value in steer.items():
        if _number(value) and value != 0:
            out[name] = _canon(value)
        elif isinstance(value, dict) and any(value.get(side) is not None for side in ("lo", "hi")):
            out[name] = [_canon(value.get("lo")), _canon(value.get("hi"))]
    return out


def _sae(body):
    """A request's SAE features and mode, canonical: {"mode", "features": {index: value}} with the
    mode "set" when left out, indices without leading zeros and numbers as floats, as the server
    reads them; {} without features (the server ignores sae_mode then)."""
    features = body.get("sae_features")
    if not isinstance(features, dict) or not features:
        return {}
    mode = body.get("sae_mode")
    return {"mode": "set" if mode is None else mode,
            "features": {str(int(k)) if str(k).isdecimal() else str(k): _canon(v) for k, v in features.items()}}


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _canon(value):
    """A number as a float (1 and 1.0 steer alike), a list of them likewise; anything else (a
    malformed value the replica refuses) as it is."""
    if isinstance(value, list):
        return [_canon(v) for v in value]
    if _number(value):
        try:
            return float(value)
        except OverflowError:  # an int past float's range: refused by the replica, kept apart here
            return value
    return value


def prefix_keys(body):
    """((key, messages covered, share of the request's text covered), ...) of a chat or completion
    body, longest first: one per prefix of `messages` (at most `MAX_KEYS`: the first message and the
    last ones), or one for a completion's `prompt` string; () for a body of neither shape. See the
    module docstring."""
    if not isinstance(body, dict):
        return ()
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list) and messages:
        kind, parts = "chat", messages
    elif isinstance(prompt, str):
        kind, parts = "completion", [prompt]
    else:
        return ()
    steering = {"kind": kind, "steer": _steering(body), "inline": body.get("steer_vectors"), "sae": _sae(body)}
    digest = _hash(_canonical(steering))
    texts = [_canonical(part) for part in parts]
    ends = [sum(map(len, texts[:j])) for j in range(len(texts) + 1)]  # text before message j
    keys = []
    for covered, text in enumerate(texts, 1):
        digest = _hash(digest + text)
        # the replica that answered these messages also holds its reply, when the next one is it
        reply = covered < len(parts) and isinstance(parts[covered], dict) and parts[covered].get("role") == "assistant"
        keys.append((digest, covered, ends[covered + reply] / (ends[-1] or 1)))
    if len(keys) > MAX_KEYS:
        keys = keys[:1] + keys[-(MAX_KEYS - 1):]
    return tuple(reversed(keys))


def _canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _hash(text):
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
