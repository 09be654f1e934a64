"""Vectors carried inline by requests (`steer_vectors`): == the same vector loaded by name; rows with
different inline vectors batched == each alone; the prefix store keys on them; slots lent and given
back; 400s and 429s naming what is wrong."""
import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from kvwire.serve import create_app

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
            dict(steer_vectors=[inline(vectors["happy"], 0.5), inline(vectors["formal"], 1.0)]), {},
            dict(steer={"happy": 1.0})]
    alone = [ask(api, **a) for a in asks]
    with ThreadPoolExecutor(3) as pool:  # 4 slots: the three inline requests (4 vectors) hold them at once
        together = list(pool.map(lambda a: ask(api, **a), asks))
    for (t1, l1), (t2, l2) in zip(alone, together):
        assert t1 == t2 and l1 == pytest.approx(l2, abs=1e-4)
    assert alone[0] == alone[4]  # inline happy at 1.0 == named happy at 1.0
    bank = server.app.state.served.inline
    assert bank.digests == [None] * 4  # every slot given back


def test_the_prefix_store_keys_on_the_vector(lm, api):
    vectors = control_vectors(lm)
    first = ask(api, steer_vectors=[inline(vectors["happy"], 1.0)])
    # the same prompt with another vector in (probably) the same slot must not reuse the first's keys/values
    other = ask(api, steer_vectors=[inline(vectors["formal"], 1.0)])
    assert other == ask(api, steer={"formal": 1.0})
    assert first == ask(api, steer={"happy": 1.0})


def test_busy_slots_answer_429_and_are_given_back(lm, server, api):
    bank = server.app.state.served.inline
    held = [bank.acquire({1: torch.ones(32)}) for _ in range(4)]
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
    ({"directions": {"1": b64([float("nan")] * 32)}}, "holds NaN or infinite values"),
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
    with pytest.raises(ValueError, match="is made for 'clamp'; a server steers with vectors that add or ablate"):
        create_app(lm, "tiny", max_batch=1, max_length=64, playground=False,
                   control_vectors={"c": kw.ControlVector(d.directions, operation="clamp")})


def test_an_inline_ablation_equals_the_models_ablation(lm, api):
    import kvwire as kw

    formal = control_vectors(lm)["formal"]
    item = {**inline(formal, 1.0), "operation": "ablate"}
    text, _ = ask(api, steer_vectors=[item])
    assert text == lm.ablate(kw.ControlVector(formal.directions)).chat(HELLO, max_new_tokens=8)
    assert text != ask(api)[0]
    half, _ = ask(api, steer_vectors=[{**item, "strength": 0.5}])
    assert half == lm.ablate(kw.ControlVector(formal.directions), strength=0.5).chat(HELLO, max_new_tokens=8)
    for bad, message in [({**item, "operation": "clamp"}, "operation is 'clamp'; expected one of ['add', 'ablate']"),
                         ({"directions": {"1": [0.0] * 32}, "operation": "ablate"}, "is all zeros: it has no direction")]:
        r = api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "steer_vectors": [bad]})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
