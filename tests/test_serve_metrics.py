"""`GET /metrics`: Prometheus' text format, parsed by prometheus_client's own parser, and counters
that move by what known requests report in their usage. Tiny chat model over uvicorn."""
import json
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

import kvwire as kw  # noqa: E402
from kvwire.serve import create_app  # noqa: E402
from kvwire.serve.metrics import Metrics  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402
from .test_sae import random_sae, write_sae  # noqa: E402

HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two vectors to add, one made to clamp ("calm"), inline slots and an SAE at block 1."""
    lm = tiny_chat_lm()
    vectors = control_vectors(lm)
    vectors["calm"] = kw.ControlVector(vectors["formal"].directions, operation="clamp")
    sae = write_sae(tmp_path_factory.mktemp("sae") / "blocks.1", random_sae(jumprelu=True))
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=128, control_vectors=vectors, inline_slots=2,
                          sae=str(sae), sae_slots=4))
    s.direction = vectors["formal"].directions[1].tolist()
    yield s
    s.close()


def scrape(server):
    """{(sample name, sorted label items): value} of one GET /metrics."""
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(response.text) for s in family.samples}


def moved(before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def post(server, path, **body):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_counters_move_by_the_usage_of_known_requests(server):
    before = scrape(server)
    usage = post(server, CHAT, messages=HELLO, max_tokens=6, temperature=0)["usage"]
    after = scrape(server)
    assert moved(before, after, "kvwire_prompt_tokens_total") == usage["prompt_tokens"]
    assert moved(before, after, "kvwire_generation_tokens_total") == usage["completion_tokens"] >= 1
    assert moved(before, after, "kvwire_http_requests_total", endpoint=CHAT, method="POST", status="200") == 1
    assert moved(before, after, "kvwire_time_to_first_token_seconds_count") == 1
    assert moved(before, after, "kvwire_steered_requests_total") == 0
    assert moved(before, after, "kvwire_generation_requests_total", finish_reason="length") + \
        moved(before, after, "kvwire_generation_requests_total", finish_reason="stop") == 1
    # two prompts, two choices each: a prompt counts once (as usage), every choice's tokens count
    before = after
    usage = post(server, "/v1/completions", prompt=["Once upon", "a time"], n=2, max_tokens=4, seed=1)["usage"]
    after = scrape(server)
    assert moved(before, after, "kvwire_prompt_tokens_total") == usage["prompt_tokens"] == len("Once upon") + len("a time")
    assert moved(before, after, "kvwire_generation_tokens_total") == usage["completion_tokens"]
    assert moved(before, after, "kvwire_time_to_first_token_seconds_count") == 4
    assert moved(before, after, "kvwire_time_per_output_token_seconds_count") >= 1


def test_prefix_hits_and_steering_are_counted(server):
    conversation = [{"role": "user", "content": "Tell me about the sea"}]
    post(server, CHAT, messages=conversation, max_tokens=4, temperature=0)
    before = scrape(server)
    usage = post(server, CHAT, messages=conversation, max_tokens=4, temperature=0)["usage"]
    after = scrape(server)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and moved(before, after, "kvwire_prefix_cache_hit_tokens_total") == cached
    for steer, counted in (({"happy": 0.5}, 1), ({"happy": 0.0}, 0), ({"formal": -1, "happy": 0}, 1)):
        before = scrape(server)
        post(server, CHAT, messages=HELLO, max_tokens=2, steer=steer)
        assert moved(before, scrape(server), "kvwire_steered_requests_total") == counted, steer


# (request fields, whether it steers): clamps (named, inline) and SAE features count once they do something
STEERING = [
    (dict(steer={"calm": {"lo": -1.0, "hi": 2.0}}), True), (dict(steer={"calm": {"hi": 0.5}}), True),
    (dict(steer={"calm": {}, "happy": 0.0}), False), (dict(steer={"calm": {"lo": None, "hi": None}}), False),
    (dict(steer_vectors=[{"operation": "clamp", "hi": 0.5}]), True),
    (dict(steer_vectors=[{"operation": "clamp"}]), False),
    (dict(steer_vectors=[{"operation": "ablate"}]), True), (dict(steer_vectors=[{"strength": 0.0}]), False),
    (dict(sae_features={"5": 6.0}), True), (dict(sae_features={"5": 0.0}), True),  # set to 0: switched off
    (dict(sae_features={"5": 0.0}, sae_mode="add"), False), (dict(sae_features={"5": 2.0}, sae_mode="add"), True),
    (dict(sae_features={"5": [None, 0.5]}, sae_mode="clamp"), True),
    (dict(sae_features={"5": [None, None]}, sae_mode="clamp"), False),
]


@pytest.mark.parametrize("fields, counted", STEERING)
def test_clamps_inline_vectors_and_sae_features_count_as_steering(server, fields, counted):
    if "steer_vectors" in fields:
        fields = {"steer_vectors": [{"directions": {"1": server.direction}, **v} for v in fields["steer_vectors"]]}
    before = scrape(server)
    post(server, CHAT, messages=HELLO, max_tokens=2, **fields)
    assert moved(before, scrape(server), "kvwire_steered_requests_total") == counted, fields


def test_a_stream_is_counted_once_it_ends(server):
    before = scrape(server)
    with httpx.stream("POST", server.url + CHAT, timeout=60, json={
            "messages": HELLO, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    after = scrape(server)
    assert moved(before, after, "kvwire_generation_tokens_total") == usage["completion_tokens"]
    assert moved(before, after, "kvwire_prompt_tokens_total") == usage["prompt_tokens"]


def test_refusals_are_counted_by_route_not_by_url(server):
    before = scrape(server)
    assert httpx.post(server.url + CHAT, json={"messages": []}).status_code == 400
    assert httpx.get(f"{server.url}/v1/models/other-model").status_code == 404
    assert httpx.get(f"{server.url}/v1/models/another").status_code == 404
    assert httpx.get(f"{server.url}/no/such/page").status_code == 404
    assert httpx.get(server.url + CHAT).status_code == 405
    after = scrape(server)
    assert moved(before, after, "kvwire_http_requests_total", endpoint=CHAT, method="POST", status="400") == 1
    assert moved(before, after, "kvwire_http_requests_total", endpoint="/v1/models/{name:path}", method="GET",
                 status="404") == 2
    assert moved(before, after, "kvwire_http_requests_total", endpoint="unmatched", method="GET", status="404") == 1
    assert moved(before, after, "kvwire_http_requests_total", endpoint=CHAT, method="GET", status="405") == 1
    assert moved(before, after, "kvwire_prompt_tokens_total") == 0


def test_the_queue_and_rows_are_read_when_scraped(server):
    """With the engine held between steps, submitted requests wait: the gauge counts them."""
    gauges = scrape(server)
    assert gauges[("kvwire_rows", ())] == 2 and gauges[("kvwire_requests_waiting", ())] == 0
    bridge, answers = server.app.state.bridge, []
    with bridge.gate.exclusive():
        workers = [threading.Thread(target=lambda: answers.append(post(server, CHAT, messages=HELLO, max_tokens=2)))
                   for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while bridge.waiting < 3:
            assert time.monotonic() < deadline, bridge.waiting
            time.sleep(0.01)
        assert scrape(server)[("kvwire_requests_waiting", ())] == 3
    for w in workers:
        w.join(60)
    assert len(answers) == 3
    gauges = scrape(server)
    assert gauges[("kvwire_requests_waiting", ())] == 0 and gauges[("kvwire_rows_running", ())] == 0


def test_steps_being_built_are_read_when_scraped(server, monkeypatch):
    from kvwire.generate import background

    # relative: on a slow machine an earlier test's build may still be in flight
    before = scrape(server)[("kvwire_compiled_steps_building", ())]
    monkeypatch.setitem(background._PENDING, Path("/nowhere/a.pt2"), object())  # as a Building queued
    assert scrape(server)[("kvwire_compiled_steps_building", ())] == before + 1


def test_each_app_has_its_own_registry():
    first, second = Metrics(), Metrics()  # the global registry would refuse the second's names
    first.record_response("/health", "GET", 200)
    first.record_response("/health", "BREW", 418)  # odd methods share one label value
    assert first.registry.get_sample_value("kvwire_http_requests_total",
                                           {"endpoint": "/health", "method": "other", "status": "418"}) == 1
    assert second.registry.get_sample_value("kvwire_http_requests_total",
                                            {"endpoint": "/health", "method": "GET", "status": "200"}) is None


def test_constrained_rows_report_their_mask_time(server):
    before = scrape(server)
    post(server, CHAT, messages=HELLO, max_tokens=4, response_format={"type": "json_object"})
    after = scrape(server)
    assert moved(before, after, "kvwire_constraint_mask_seconds_total") > 0
    assert moved(before, after, "kvwire_decode_steps_total") >= 1  # the object may end early ("{}")


def test_metrics_can_be_turned_off():
    lm = tiny_chat_lm()
    s = Server(create_app(lm, "tiny", max_batch=1, max_length=64, metrics=False))
    try:
        assert httpx.get(f"{s.url}/metrics", timeout=30).status_code == 404
        post(s, CHAT, messages=HELLO, max_tokens=2)
    finally:
        s.close()
