"""Vectors carried inline by requests (`steer_vectors`): == the same vector loaded by name; rows with
different inline vectors and operations (add, ablate, clamp) batched == each alone; the prefix store
keys on them; slots lent and given back; 400s and 429s naming what is wrong. Named clamp vectors take
their bounds per request."""
import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from kvwire.serve import create_app
from kvwire.serve.inline import Inline, SlotSteer
from kvwire.steer import Steer
from kvwire.steer.ops import Ablate, Clamp

from .serve_fixtures import Server, control_vectors, tiny_chat_lm

HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm):
    app = create_app(lm, "tiny", max_batch=4, max_length=128, control_vectors=control_vectors(lm), inline_slots=4,
                     inline_per_request=2)
    s = Server(app)
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def b64(t):
    return base64.b64encode(np.asarray(t, dtype="<f4").tobytes()).decode()


def inline(vector, strength=1.0, encode=b64):
    return {"directions": {str(i): encode(v) for i, v in vector.directions.items()}, "strength": strength}


def clamp(vector, lo=None, hi=None):
    bounds = {side: value for side, value in (("lo", lo), ("hi", hi)) if value is not None}
    return {"directions": {str(i): b64(v) for i, v in vector.directions.items()}, "operation": "clamp", **bounds}


def ask(api, **extra):
    r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, "temperature": 0, "logprobs": True,
                                               **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], [e["logprob"] for e in choice["logprobs"]["content"]]


def test_an_inline_vector_equals_the_same_vector_by_name(lm, api):
    happy = control_vectors(lm)["happy"]
    by_name = ask(api, steer={"happy": 1.5})
    for encode in (b64, lambda t: t.tolist()):
        text, lps = ask(api, steer_vectors=[inline(happy, 1.5, encode)])
        assert text == by_name[0] and lps == pytest.approx(by_name[1], abs=1e-4)
    assert ask(api) != by_name


def test_rows_with_different_inline_vectors_batch_as_each_alone(lm, api, server):
    vectors = control_vectors(lm)
    asks = [dict(steer_vectors=[inline(vectors["happy"], 1.0)]), dict(steer_vectors=[inline(vectors["formal"], -1.0)]),
            dict(steer_vectors=[inline(vectors["happy"], 0.5), clamp(vectors["formal"], 1.0, 1.0)]), {},
            dict(steer={"happy": 1.0}), dict(steer_vectors=[{**inline(vectors["formal"]), "operation": "ablate"}])]
    alone = [ask(api, **a) for a in asks]
    with ThreadPoolExecutor(4) as pool:  # 4 slots: the four inline requests (4 vectors) hold them at once
        together = list(pool.map(lambda a: ask(api, **a), asks))
    for (t1, l1), (t2, l2) in zip(alone, together):
        assert t1 == t2 and l1 == pytest.approx(l2, abs=1e-4)
    # inline happy at 1.0 == named happy at 1.0 (within float rounding: either may be restored from
    # the prefix store, whose rows continue a prompt in other chunks than a fresh prefill)
    assert alone[0][0] == alone[4][0] and alone[0][1] == pytest.approx(alone[4][1], abs=1e-4)
    differ = {tuple(round(lp, 3) for lp in lps) for text, lps in alone[:4] + alone[5:]}
    assert len(differ) == 5  # five different steerings (add, clamp, none, ablate), five different replies
    bank = server.app.state.served.inline
    assert bank.digests == [None] * 4  # every slot given back


def test_the_prefix_store_keys_on_the_vector(lm, api, server):
    """Another vector in the same slot (every other slot lent) does not reuse the first's keys and
    values. (Replies are compared within float rounding: a row restored from the prefix store sums
    in another order than a fresh prefill.)"""
    vectors, bank = control_vectors(lm), server.app.state.served.inline
    first = ask(api, steer_vectors=[inline(vectors["happy"], 1.0)])
    slot = bank.held.index(_digest_of(vectors["happy"]))
    others = [bank.acquire(Inline({1: torch.full((32,), k + 2.0)})) for k in range(bank.slots - 1)]
    try:
        assert slot not in others
        other = ask(api, steer_vectors=[inline(vectors["formal"], 1.0)])
        assert bank.held[slot] == _digest_of(vectors["formal"])
    finally:
        bank.release(others)
    for got, want in ((other, ask(api, steer={"formal": 1.0})), (first, ask(api, steer={"happy": 1.0}))):
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)


def test_a_vector_sent_again_takes_its_slot_and_reuses_its_prefix(lm, api, server):
    """A slot's index is part of its rows' runtime inputs, so of their prefix-store keys: a vector
    sent again takes the slot it had (others take the slot given back longest ago) and its prompt's
    keys/values are restored, even when another vector was lent in between."""
    bank, formal = server.app.state.served.inline, control_vectors(lm)["formal"]
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, "steer_vectors": [inline(formal, 0.7)]}
    first = api.post("/v1/chat/completions", json=body).json()
    slot = bank.held.index(_digest_of(formal))
    other = bank.acquire(Inline({1: torch.ones(32)}))  # another vector, held while the first is sent again
    try:
        assert other != slot
        again = api.post("/v1/chat/completions", json=body).json()
    finally:
        bank.release([other])
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert bank.held[slot] == _digest_of(formal)


def test_requests_sending_the_same_vector_share_its_slot(lm, api, server):
    """Two requests with one vector hold one slot (each row its own strength), freed when the last
    ends; one request sending a vector twice holds two slots, whose strengths add."""
    bank, happy = server.app.state.served.inline, control_vectors(lm)["happy"]
    a = bank.acquire(Inline({1: torch.full((32,), 5.0)}))
    b = bank.acquire(Inline({1: torch.full((32,), 5.0)}))
    c = bank.acquire(Inline({1: torch.full((32,), 5.0)}), taken=[a])
    try:
        assert a == b != c and bank.users[a] == 2 and bank.users[c] == 1
        bank.release([b])
        assert bank.digests[a] is not None  # still lent to the first
    finally:
        bank.release([a, c])
    assert bank.digests == [None] * bank.slots
    twice = ask(api, steer_vectors=[inline(happy, 0.5), inline(happy, 0.5)])
    assert twice[0] == ask(api, steer={"happy": 1.0})[0]
    assert twice[1] == pytest.approx(ask(api, steer={"happy": 1.0})[1], abs=1e-4)
    with ThreadPoolExecutor(3) as pool:  # one vector, three strengths at once: each its own reply
        together = list(pool.map(lambda s: ask(api, steer_vectors=[inline(happy, s)]), (0.5, 1.0, 1.5)))
    for s, got in zip((0.5, 1.0, 1.5), together):
        want = ask(api, steer={"happy": s})
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)


def _digest_of(vector, operation="add"):
    """The bank's digest of a vector sent inline (`inline`) with `operation`, no bounds."""
    from kvwire.serve.inline import _digest

    directions = {i: torch.from_numpy(np.asarray(v, dtype="<f4")) for i, v in vector.directions.items()}
    return f"{operation}:None:None:{_digest(directions)}"


def test_busy_slots_answer_429_and_are_given_back(lm, server, api):
    bank = server.app.state.served.inline
    held = [bank.acquire(Inline({1: torch.full((32,), k + 1.0)})) for k in range(4)]
    try:
        r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2,
                                                   "steer_vectors": [inline(control_vectors(lm)["happy"])]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "inline_slots_busy"
    finally:
        bank.release(held)
    assert ask(api, steer_vectors=[inline(control_vectors(lm)["happy"])])


BAD = [
    ({"directions": {"1": "not base64!"}}, "steer_vectors[0].directions.1 is not valid base64"),
    ({"directions": {"1": base64.b64encode(b"\0" * 12).decode()}}, "decodes to 12 bytes; expected 128 (32 little-endian float32)"),
    ({"directions": {"1": [0.0] * 31}}, "has 31 numbers; expected 32"),
    ({"directions": {"1": b64([float("nan")] * 32)}}, "holds NaN, infinite or past-float32 values"),
    ({"directions": {"1": [1e39] + [0.0] * 31}}, "steer_vectors[0].directions.1 holds NaN, infinite or past-float32"),
    ({"directions": {"9": [0.0] * 32}}, "has block '9'; inline vectors may steer blocks 0-3"),
    ({"directions": {}}, "directions is empty"),
]


@pytest.mark.parametrize("item, message", BAD)
def test_bad_inline_vectors_are_400s_naming_what_is_wrong(api, item, message):
    r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "steer_vectors": [item]})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == "steer_vectors"


def test_too_many_inline_vectors_and_a_server_without_slots(lm, api):
    item = {"directions": {"1": [0.0] * 32}}
    r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "steer_vectors": [item] * 3})
    assert r.status_code == 400 and "has 3 vectors; this server allows at most 2 per request" in r.text
    plain = Server(create_app(lm, "tiny", max_batch=1, max_length=64, inline_slots=0, playground=False))
    try:
        r = httpx.post(plain.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "steer_vectors": [item]})
        assert r.status_code == 400 and "takes no inline vectors" in r.text
    finally:
        plain.close()


def test_a_named_ablation_vector_is_served_with_per_request_strength(lm):
    import kvwire as kw

    d = control_vectors(lm)["happy"]
    refusal = kw.ControlVector(d.directions, operation="ablate", site="attn_out")
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=64, control_vectors={"refusal": refusal},
                          playground=False, inline_slots=0))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as api:
            on, off = ask(api, steer={"refusal": 1.0}), ask(api)
        ablated = lm.ablate(refusal).chat(HELLO, max_new_tokens=8)
        assert on[0] == ablated and off[0] == lm.chat(HELLO, max_new_tokens=8) and on != off
    finally:
        s.close()


def test_an_inline_ablation_equals_the_models_ablation(lm, api):
    import kvwire as kw

    formal = control_vectors(lm)["formal"]
    item = {**inline(formal, 1.0), "operation": "ablate"}
    text, _ = ask(api, steer_vectors=[item])
    assert text == lm.ablate(kw.ControlVector(formal.directions)).chat(HELLO, max_new_tokens=8)
    assert text != ask(api)[0]
    half, _ = ask(api, steer_vectors=[{**item, "strength": 0.5}])
    assert half == lm.ablate(kw.ControlVector(formal.directions), strength=0.5).chat(HELLO, max_new_tokens=8)
    for bad, message in [({**item, "operation": "scale"}, "operation is 'scale'; expected one of ['add', 'ablate', 'clamp']"),
                         ({"directions": {"1": [0.0] * 32}, "operation": "ablate"}, "is all zeros: it has no direction")]:
        r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "steer_vectors": [bad]})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("lo, hi", [(2.0, 2.0), (None, -3.0), (3.0, None), (-0.5, 0.5)])
def test_an_inline_clamp_equals_the_models_clamp(lm, api, lo, hi):
    import kvwire as kw

    formal = control_vectors(lm)["formal"]
    text, lps = ask(api, steer_vectors=[clamp(formal, lo, hi)])
    reference = lm.clamp(kw.ControlVector(formal.directions), lo, hi)
    assert text == reference.chat(HELLO, max_new_tokens=8)
    assert lps != pytest.approx(ask(api)[1], abs=1e-3)  # the bounds bite: a clamp that did nothing fails here


def test_the_slot_layer_equals_add_ablate_and_clamp_per_row():
    """One SlotSteer, three slots (add, ablate, clamp), rows each using one (or none) == the
    reference operation on that row alone, and a branch-free graph (it traces)."""
    g = torch.Generator().manual_seed(0)
    d = torch.randn(3, 8, generator=g)
    layer = SlotSteer(3, 8)
    layer.directions[0] = d[0]
    layer.units[1], layer.units[2] = d[1] / d[1].norm(), d[2] / d[2].norm()
    x = torch.randn(4, 5, 8, generator=g) * 3
    inputs = {k: v.clone() for k, v in layer.runtime_defaults(4).items()}
    inputs["inline0_strength"][0] = 1.5
    inputs["inline1_strength"][1] = 0.7
    inputs["inline2_lo"][2], inputs["inline2_hi"][2] = -0.5, 0.25
    out = layer.forward_cached(x, positions=torch.arange(5)[None].expand(4, -1), **inputs)
    references = [Steer(d[0], 1.5), Ablate(d[1], 0.7), Clamp(d[2], -0.5, 0.25), None]
    for row, op in enumerate(references):
        want = x[row:row + 1] if op is None else op(x[row:row + 1])
        assert torch.allclose(out[row:row + 1], want, atol=1e-5), row
    assert not torch.allclose(out, x)
    torch.fx.symbolic_trace(layer)  # no data-dependent Python control flow


def test_the_slot_layers_are_skipped_eagerly_only_while_no_slot_is_lent(lm, monkeypatch):
    from kvwire.serve.inline import InlineBank

    bank = InlineBank(lm, slots=2)
    happy = control_vectors(lm)["happy"]
    layer = bank.layers[next(iter(happy.directions))]
    x = torch.randn(2, 3, layer.directions.shape[1])
    positions = torch.arange(3)[None].expand(2, -1)
    inputs = layer.runtime_defaults(2)
    acted = []
    act = SlotSteer.act
    monkeypatch.setattr(SlotSteer, "act", lambda self, *a: acted.append(self) or act(self, *a))
    assert layer.forward_cached(x, positions=positions, **inputs) is x and not acted  # every slot free
    slot = bank.acquire(Inline(dict(happy.directions), "add"))
    assert all(not each.idle for each in bank.layers.values())
    given = {**inputs, f"inline{slot}_strength": torch.tensor([1.0, 0.0])}
    out = layer.forward_cached(x, positions=positions, **given)
    assert acted == [layer] and not torch.equal(out[0], x[0]) and torch.equal(out[1], x[1])
    # inert rows of a lent slot: the products give x itself, what the skip returns
    assert torch.equal(layer.forward_cached(x, positions=positions, **inputs), x)
    bank.release([slot])
    assert all(each.idle for each in bank.layers.values())
    assert layer.forward_cached(x, positions=positions, **inputs) is x and len(acted) == 2
    traced = torch.fx.symbolic_trace(layer)  # a trace keeps the products while idle: inputs decide
    assert any(n.op == "call_method" or n.op == "call_function" for n in traced.graph.nodes
               if "matmul" in str(n.target))


def test_the_slot_layers_defaults_are_inert_and_written_one_at_a_time():
    from kvwire.steer.ops import LIMIT

    layer = SlotSteer(3, 8)
    defaults = layer.runtime_defaults(2)
    assert set(defaults) == set(layer.runtime_inputs)
    for k in range(3):
        assert defaults[f"inline{k}_strength"].tolist() == [0.0, 0.0]
        assert defaults[f"inline{k}_lo"].tolist() == [-LIMIT, -LIMIT] and defaults[f"inline{k}_hi"].tolist() == [LIMIT] * 2
    inline = [v for name, v in defaults.items() if name.startswith("inline")]
    assert all(v.is_contiguous() and v.data_ptr() % 64 == 0 for v in inline)  # as compiled steps take them
    defaults["inline1_strength"][1] = 2.0  # a row's value set in place, as the engine sets its rows'
    assert [defaults[f"inline{k}_strength"].tolist() for k in range(3)] == [[0.0, 0.0], [0.0, 2.0], [0.0, 0.0]]
    assert defaults["inline1_lo"].tolist() == [-LIMIT, -LIMIT]


def test_a_clamps_digest_holds_its_operation_and_bounds(server):
    bank = server.app.state.served.inline
    directions = {1: torch.ones(32)}
    items = [Inline(directions, "clamp", lo=-1.0, hi=1.0), Inline(directions, "clamp", lo=-1.0, hi=2.0),
             Inline(directions, "clamp", hi=1.0), Inline(directions, "ablate"), Inline(directions)]
    digests = []
    for item in items:  # one at a time: each in the same free slot
        slot = bank.acquire(item)
        digests.append(bank.digest(slot))
        bank.release([slot])
    assert len(set(digests)) == len(items)


def test_the_prefix_store_keys_on_the_bounds(lm, api):
    import kvwire as kw

    formal = control_vectors(lm)["formal"]
    for lo, hi in [(1.0, 1.0), (-2.0, -2.0), (1.0, 1.0)]:  # the same prompt again and again, bounds changing
        text, _ = ask(api, steer_vectors=[clamp(formal, lo, hi)])
        assert text == lm.clamp(kw.ControlVector(formal.directions), lo, hi).chat(HELLO, max_new_tokens=8)


CLAMP_BAD = [
    ({"lo": 2.0, "hi": 1.0}, "steer_vectors[0]: lo 2.0 > hi 1.0; expected lo <= hi"),
    ({"lo": float("nan")}, "steer_vectors[0].lo is nan; expected a finite number"),
    ({"hi": float("inf")}, "steer_vectors[0].hi is inf; expected a finite number"),
    ({"lo": 0.0, "strength": 2.0}, "steer_vectors[0].strength is 2.0, but a clamp takes no strength"),
    ({"operation": "add", "hi": 1.0}, "steer_vectors[0].hi is 1.0, but hi applies to operation 'clamp' only; this "
                                      "vector's operation is 'add'"),
    ({"directions": {"1": [0.0] * 32}, "lo": 0.0}, "steer_vectors[0].directions.1 is all zeros: it has no direction "
                                                   "to clamp"),
]


@pytest.mark.parametrize("change, message", CLAMP_BAD)
def test_bad_clamps_are_400s_naming_what_is_wrong(lm, api, change, message):
    import json

    item = {**clamp(control_vectors(lm)["formal"]), **change}
    # NaN and Infinity as Python's json writes them (and reads them)
    body = json.dumps({"messages": HELLO, "max_tokens": 2, "steer_vectors": [item]})
    r = api.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == "steer_vectors"


def test_a_named_clamp_vector_takes_its_bounds_per_request(lm):
    import kvwire as kw

    d = control_vectors(lm)["formal"]
    calm = kw.ControlVector(d.directions, operation="clamp")
    served = {"calm": calm, "happy": control_vectors(lm)["happy"]}
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=64, control_vectors=served, playground=False,
                          inline_slots=0))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as api:
            on, off = ask(api, steer={"calm": {"lo": 1.0, "hi": 1.0}}), ask(api)
            upper = ask(api, steer={"calm": {"hi": -3.0}, "happy": 0.0})
            unbounded = ask(api, steer={"calm": {}})  # no bounds: the clamp does nothing
            assert unbounded[0] == off[0] and unbounded[1] == pytest.approx(off[1], abs=1e-4)
            bad = [({"calm": 1.0}, "steer.calm is 1.0, but 'calm' is a vector made to clamp: expected its bounds"),
                   ({"calm": {"lo": 2, "hi": 1}}, "steer.calm: lo 2 > hi 1; expected lo <= hi"),
                   ({"happy": {"lo": 1}}, "steer.happy is {'lo': 1, 'hi': None}, but 'happy' is a vector to add or "
                                          "ablate: expected a strength"),
                   ({"calm": {"lo": 1, "mid": 2}}, "mid")]
            for steer, message in bad:
                r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "steer": steer})
                assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert on[0] == lm.clamp(calm, 1.0, 1.0).chat(HELLO, max_new_tokens=8) != off[0]
        assert upper[0] == lm.clamp(calm, None, -3.0).chat(HELLO, max_new_tokens=8) != off[0]
        assert off[0] == lm.chat(HELLO, max_new_tokens=8)
    finally:
        s.close()
