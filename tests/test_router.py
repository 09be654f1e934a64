"""The scale-out router (`kvwire.serve.router`): requests go to replicas that hold their control
vectors, then to the one that served their conversation, then to the least loaded; a replica that
lacks the vectors is recorded to load them; prefix keys stay within their LRU bound. Fake replicas
(`Fleet`) play the servers: they load what a route tells them and answer at once or on demand."""
import pytest

from kvwire.serve.router import MAX_KEYS, Route, SteeringRouter, prefix_keys, wanted_vectors

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*turns, steer=None):
    """A chat body: the system message, then user/assistant turns alternating."""
    messages = [SYSTEM] + [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"messages": messages, **({"steer": steer} if steer is not None else {})}


class Fleet:
    """Fake replicas: each loads the vectors a route names (and records them), holds requests in
    flight until `done`, and reports what it holds to the router, as the Ray ingress does."""

    def __init__(self, n=2, **options):
        self.router = SteeringRouter([f"r{i}" for i in range(n)], **options)
        self.held = {r: set(self.router.holds(r)) for r in self.router.replicas}
        self.loaded = {r: [] for r in self.router.replicas}
        self.open = []

    def send(self, body, finish=True):
        route = self.router.route(wanted_vectors(body), prefix_keys(body))
        self.held[route.replica] |= route.load
        self.loaded[route.replica] += sorted(route.load)
        self.router.observe(route, self.held[route.replica])
        assert wanted_vectors(body) <= self.held[route.replica], "served without its vectors"
        if finish:
            self.router.finish(route.replica)
        else:
            self.open.append(route.replica)
        return route

    def done(self):
        for replica in self.open:
            self.router.finish(replica)
        self.open.clear()


def test_a_request_goes_to_a_replica_holding_all_its_vectors():
    fleet = Fleet(3)
    assert fleet.send(chat("a", steer={"happy": 1.0})) == Route("r0", frozenset({"happy"}))
    assert fleet.send(chat("b", steer={"formal": -1.0})) == Route("r1", frozenset({"formal"}))
    # r0 and r1 hold one vector each, r2 none: the next new vector goes to r2 (fewest held)
    assert fleet.send(chat("c", steer={"calm": 0.5})).replica == "r2"
    for i in range(4):  # known vectors stay where they are, whatever the order
        assert fleet.send(chat(f"d{i}", steer={"formal": 2.0})).replica == "r1"
        assert fleet.send(chat(f"e{i}", steer={"happy": 0.5})).replica == "r0"
    # both vectors: nobody holds both; each of r0, r1 lacks one, so the one routed fewer requests loads it
    both = fleet.send(chat("f", steer={"happy": 1.0, "formal": 1.0}))
    assert both.load in ({"formal"}, {"happy"}) and both.replica in ("r0", "r1")
    assert fleet.send(chat("g", steer={"formal": 1.0, "happy": 3.0})) == Route(both.replica)
    assert fleet.loaded == {"r0": ["happy"], "r1": ["formal"], "r2": ["calm"], both.replica: fleet.loaded[both.replica]}
    assert sum(len(v) for v in fleet.loaded.values()) == 4  # each load happened once


def test_strength_zero_and_malformed_strengths_want_no_vector():
    assert wanted_vectors({"steer": {"happy": 0, "formal": 0.0, "calm": -1e-3, "bad": "lots", "t": True}}) == {"calm"}
    assert wanted_vectors({"steer": ["happy"]}) == wanted_vectors(None) == frozenset()
    fleet = Fleet(2, vectors={"happy"})
    assert fleet.send(chat("a", steer={"formal": 0.0})) == Route("r0")  # nothing to load
    assert fleet.router.holds("r1") == {"happy"}  # vectors every replica starts with


def test_a_clamp_vector_with_a_bound_is_wanted_and_loaded():
    steer = {"calm": {"lo": -1, "hi": 2}, "cool": {"hi": 0.5}, "open": {}, "nulls": {"lo": None, "hi": None},
             "odd": {"lo": "low"}, "happy": 0}
    # unbounded on both sides clamps nothing (as strength 0); a malformed bound is the replica's to refuse
    assert wanted_vectors({"steer": steer}) == {"calm", "cool", "odd"}
    fleet = Fleet(2)
    assert fleet.send(chat("a", steer={"calm": {"lo": -1, "hi": 2}})) == Route("r0", frozenset({"calm"}))
    assert fleet.send(chat("b", steer={"cool": {"hi": 0.5}, "calm": {}})) == Route("r1", frozenset({"cool"}))
    assert fleet.send(chat("c", steer={"calm": {"lo": 0}})) == Route("r0")  # its holder, though routed more
    assert fleet.send(chat("d", steer={"calm": {}, "cool": {"lo": None}})) == Route("r1")  # none wanted: fewest routed


def test_the_prefix_key_holds_clamp_bounds_canonically():
    def key(steer):
        return prefix_keys(chat("hi", steer=steer))[0][0]

    assert key({"calm": {"lo": -1, "hi": 2}}) == key({"calm": {"hi": 2.0, "lo": -1.0}})
    assert key({"calm": {"lo": -1}}) == key({"calm": {"lo": -1.0, "hi": None}})
    assert len({key({"calm": {"lo": -1, "hi": 2}}), key({"calm": {"lo": -1, "hi": 3}}), key({"calm": {"lo": -1}}),
                key({"calm": {"hi": -1}}), key({"calm": -1}), key(None)}) == 6
    assert key({"calm": {}}) == key({"calm": {"lo": None}}) == key(None)  # no bound: no steering


def test_the_prefix_key_holds_sae_features_and_their_mode():
    def key(**sae):
        return prefix_keys({**chat("hi"), **sae})[0][0]

    plain = key()
    assert key(sae_features={"5": 6.0, "7": 0}) == key(sae_features={"7": 0.0, "05": 6}) == \
        key(sae_features={"5": 6, "7": 0}, sae_mode="set")  # the order, spelling and the default mode
    assert key(sae_features={}, sae_mode="add") == key(sae_mode="clamp") == plain  # a mode alone steers nothing
    assert len({plain, key(sae_features={"5": 6.0}), key(sae_features={"5": 7.0}), key(sae_features={"6": 6.0}),
                key(sae_features={"5": 6.0}, sae_mode="add"), key(sae_features={"5": [None, 6.0]}, sae_mode="clamp"),
                key(sae_features={"5": [6.0, None]}, sae_mode="clamp")}) == 7
    assert key(sae_features={"²": 1, "x": [True]}) != plain  # malformed: the replica refuses them, no crash here


def test_a_conversation_returns_to_the_replica_that_served_its_earlier_turn():
    fleet = Fleet(2)
    sea, land = "Tell me all about the sea and its tides.", "Tell me all about the land and its hills."
    first = fleet.send(chat(sea), finish=False)
    other = fleet.send(chat(land), finish=False)
    # the system prompt they share is too short a part of them to count: load spreads them
    assert (first.replica, other.replica) == ("r0", "r1") and other.prefix == 0
    fleet.done()
    for repeat in range(3):  # each conversation's next turn, whatever the load order
        # served: system + first question (the reply was generated there), then the whole request
        second = fleet.send(chat(land, "The land is wide and green, with hills and valleys everywhere.", "More?"))
        assert second == Route(other.replica, prefix=4 if repeat else 2)
        again = fleet.send(chat(sea, "The sea is deep and blue, and it covers most of the planet.", "More?"))
        assert again == Route(first.replica, prefix=4 if repeat else 2)


def test_the_prefix_key_is_the_conversation_before_its_new_turn_under_its_steering():
    keys = prefix_keys(chat("hi", "hello", "how are you?"))
    assert [covered for _, covered, _ in keys] == [4, 3, 2, 1]
    earlier = {key: covered for key, covered, _ in prefix_keys(chat("hi"))}  # the turn before: system + "hi"
    assert earlier[keys[2][0]] == 2
    shares = [share for _, _, share in keys]
    assert shares[0] == 1 and shares[1] == shares[2] < 1 and shares[3] < shares[2]  # 2 covers its reply too
    assert prefix_keys(chat("hi"))[0] != prefix_keys(chat("hi", steer={"happy": 1.0}))[0]  # another steering
    assert prefix_keys(chat("hi")) == prefix_keys(chat("hi", steer={"happy": 0}))  # 0 is no steering
    assert prefix_keys(chat("hi", steer={"happy": 1, "formal": 2})) == prefix_keys(
        chat("hi", steer={"formal": 2.0, "happy": 1.0}))
    assert len(prefix_keys({"prompt": "Once upon"})) == 1
    assert prefix_keys({"prompt": "Once"}) != prefix_keys({"messages": [{"role": "user", "content": "Once"}]})
    assert prefix_keys({"prompt": ["a", "b"]}) == prefix_keys({"messages": []}) == prefix_keys("x") == ()
    long = prefix_keys({"messages": [{"role": "user", "content": str(i)} for i in range(200)]})
    assert len(long) == MAX_KEYS and long[0][1] == 200 and long[-1][1] == 1


def test_vectors_come_before_the_prefix_and_the_prefix_before_load():
    fleet = Fleet(2)
    fleet.send(chat("hello"))  # r0 serves the conversation unsteered
    fleet.send(chat("x", steer={"happy": 1.0}))  # r1 (fewer routed) loads happy
    busy = fleet.send(chat("y"), finish=False)
    assert busy.replica == "r0"  # r1 has more routed; tie on in-flight
    # the conversation's next turn goes back to r0 though r0 has one more in flight
    assert fleet.send(chat("hello", "hi", "more"), finish=False).replica == "r0"
    # steered with happy: only r1 holds it, the prefix on r0 does not count (another steering anyway)
    assert fleet.send(chat("hello", "hi", "more", steer={"happy": 1.0})).replica == "r1"


def test_load_breaks_ties_and_skew_bounds_preference():
    fleet = Fleet(2, max_skew=2)
    fleet.send(chat("a", steer={"happy": 1.0}))
    routes = [fleet.send(chat(f"q{i}", steer={"happy": 1.0}), finish=False) for i in range(4)]
    # r0 holds happy and takes requests until it has max_skew more in flight than r1 ...
    assert [r.replica for r in routes] == ["r0", "r0", "r0", "r1"]
    assert routes[3].load == {"happy"}  # ... then the least loaded replica loads the vector too
    assert fleet.router.in_flight("r0") == 3 and fleet.router.in_flight("r1") == 1
    assert fleet.send(chat("next", steer={"happy": 1.0}), finish=False).replica == "r1"  # fewest in flight
    fleet.done()  # routed so far: r0 4, r1 2; then fewest routed first, the replicas' order on a tie
    unrelated = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    assert [fleet.send(body).replica for body in unrelated] == ["r1", "r1", "r0", "r1"]


def test_unbounded_skew_keeps_a_conversation_on_its_replica_however_busy():
    fleet = Fleet(2, max_skew=None)
    fleet.send(chat("hello"))
    for _ in range(10):
        assert fleet.send(chat("hello", "hi", "go on"), finish=False).replica == "r0"


def test_prefix_keys_stay_within_the_lru_bound_and_a_load_forgets_them():
    router = SteeringRouter(["r0"], max_prefixes=5)
    first = prefix_keys(chat("first"))
    router.route(keys=first)  # 2 keys
    for i in range(3):
        router.route(keys=prefix_keys(chat(f"other {i}")))  # 1 new key each (the system prompt is shared)
    assert router.state()["r0"]["prefixes"] == 5
    assert router._hit("r0", first) == 2
    router.route(keys=prefix_keys(chat("fourth")))
    assert router.state()["r0"]["prefixes"] == 5
    assert router._hit("r0", first) == 1  # its own key evicted (least recently routed); the shared one stays
    route = router.route({"happy"}, prefix_keys(chat("steered", steer={"happy": 1.0})))
    assert route.load == {"happy"} and router.state()["r0"]["prefixes"] == 2  # the swap emptied the store
    assert router._hit("r0", first) == 0


def test_observe_believes_the_replica_but_keeps_pending_loads():
    router = SteeringRouter(["r0", "r1"])
    happy = router.route({"happy"})
    formal = router.route({"formal"}, ())
    calm = router.route({"calm"}, ())
    assert (happy.replica, formal.replica, calm.replica) == ("r0", "r1", "r0")
    router.observe(happy, {"happy"})  # calm is still loading on r0
    assert router.holds("r0") == {"happy", "calm"}
    router.observe(calm, {"happy"})  # calm failed to load
    assert router.holds("r0") == {"happy"}
    again = router.route({"calm"}, ())
    assert again == Route("r1", frozenset({"calm"}))  # asked again, of the least loaded
    for route in (happy, formal, calm, again):
        router.finish(route.replica)
    with pytest.raises(ValueError, match="replica 'r1' has no request in flight"):
        router.finish("r1")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"replicas must be distinct ids, at least one; got \['a', 'a'\]"):
        SteeringRouter(["a", "a"])
    with pytest.raises(ValueError, match=r"replicas must be distinct ids, at least one; got \[\]"):
        SteeringRouter([])
    with pytest.raises(ValueError, match="max_prefixes must be an int >= 1, got 0"):
        SteeringRouter(["a"], max_prefixes=0)
    with pytest.raises(ValueError, match="max_skew must be an int >= 0 or None, got -1"):
        SteeringRouter(["a"], max_skew=-1)
    with pytest.raises(ValueError, match=r"min_share must be a number in \[0, 1\], got 2"):
        SteeringRouter(["a"], min_share=2)
