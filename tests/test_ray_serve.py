"""Scale-out on Ray Serve (`kvwire.serve.ray_serve`): two replicas of a tiny chat model on a local
Ray instance answer steered requests as one plain server does, spread over both replicas, each
request on a replica holding its vectors (loaded on demand from a folder). A replica's in-process
forwarding and on-demand loading are tested first without Ray."""
import asyncio
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from kvwire.serve import create_app  # noqa: E402
from kvwire.serve import ray_serve  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 90  # the whole Ray test, start to shutdown
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def vector_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vectors")
    for name, vector in control_vectors(tiny_chat_lm()).items():
        vector.save(folder / f"{name}.gguf")
    return folder


@pytest.fixture(scope="module")
def plain(vector_dir):
    """One plain server holding both vectors from the start: the answers to match."""
    lm = tiny_chat_lm()
    server = Server(create_app(lm, "tiny", control_vectors=control_vectors(lm), max_batch=4, playground=False))
    yield httpx.Client(base_url=server.url, timeout=60)
    server.close()


def ask(client, path, body):
    answer = client.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer


def chat_body(messages=QUESTION, steer=None, **extra):
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, **extra,
            **({"steer": steer} if steer is not None else {})}


def reply(answer):
    """(text, token log-probabilities) of a chat or completion answer (random bytes decode alike to U+FFFD)."""
    choice = answer.json()["choices"][0]
    if "message" in choice:
        return choice["message"]["content"], [e["logprob"] for e in choice["logprobs"]["content"]]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def same(a, b):
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], abs=1e-4)


# -- one replica in this process --------------------------------------------------------------------


class InProcess:
    """A `Replica` driven on one event loop of this thread, as Ray Serve drives it on its own."""

    def __init__(self, *args, **kwargs):
        self.loop = asyncio.new_event_loop()
        self.replica = ray_serve.Replica(*args, **kwargs)

    def __call__(self, method, path, body=None, headers=()):
        """(the first item: status, headers, replica, vectors; the body's bytes)."""
        async def run():
            data = b"" if body is None else json.dumps(body).encode()
            items = [item async for item in self.replica.forward(method, path, b"", list(headers), data)]
            return items[0], b"".join(items[1:])

        return self.loop.run_until_complete(run())

    def close(self):
        self.loop.run_until_complete(self.replica.close())
        self.loop.close()


def test_a_replica_loads_vectors_on_demand_and_answers_as_the_plain_server(vector_dir, plain):
    forward = InProcess("r0", tiny_chat_lm, "tiny", str(vector_dir), app_options={"max_batch": 4})
    head, card = forward("GET", "/v1/models")
    assert json.loads(card)["data"][0]["control_vectors"] == ["formal", "happy"]  # loadable, not yet loaded
    assert head["vectors"] == [] and head["replica"] == "r0"
    for steer in ({"happy": 1.5, "formal": 0.0}, {"formal": -1.0, "happy": 0.5}, None):
        head, body = forward("POST", "/v1/chat/completions", chat_body(steer=steer))
        assert head["status"] == 200, body
        same(reply(httpx.Response(200, content=body)), reply(ask(plain, "/v1/chat/completions", chat_body(steer=steer))))
        if steer and steer["happy"] == 1.5:
            assert head["vectors"] == ["happy"]  # formal at strength 0 is not loaded
    assert head["vectors"] == ["formal", "happy"]
    head, body = forward("POST", "/v1/chat/completions", chat_body(steer={"sad": 1.0}))
    assert head["status"] == 400 and "unknown control vector names ['sad']" in json.loads(body)["error"]["message"]
    forward.close()


def test_a_replica_refuses_a_malformed_strength_as_the_plain_server_does(vector_dir, plain):
    """A strength that is not a number is refused, never dropped (which would answer unsteered)."""
    forward = InProcess("r4", tiny_chat_lm, "tiny", str(vector_dir), app_options={"max_batch": 2})
    for steer in ({"happy": "lots"}, {"happy": True}, {"happy": {"lo": "x"}}):
        head, body = forward("POST", "/v1/chat/completions", chat_body(steer=steer))
        expected = plain.post("/v1/chat/completions", json=chat_body(steer=steer))
        assert head["status"] == expected.status_code == 400, body
        assert json.loads(body)["error"]["message"] == expected.json()["error"]["message"]
    forward.close()


def test_a_replica_loads_a_clamp_vector_when_a_request_bounds_it(tmp_path):
    import kvwire as kw

    lm = tiny_chat_lm()
    calm = kw.ControlVector(control_vectors(lm)["formal"].directions, operation="clamp")
    calm.save(tmp_path / "calm.gguf")
    forward = InProcess("r3", tiny_chat_lm, "tiny", str(tmp_path), app_options={"max_batch": 2})
    server = Server(create_app(lm, "tiny", control_vectors={"calm": calm}, max_batch=2, playground=False))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as plain:
            head, body = forward("POST", "/v1/chat/completions", chat_body(steer={"calm": {}}))
            assert head["status"] == 200 and head["vectors"] == []  # no bound clamps nothing: nothing to load
            off = reply(httpx.Response(200, content=body))
            for steer in ({"calm": {"lo": 1.0, "hi": 1.0}}, {"calm": {"hi": -3.0}}):
                head, body = forward("POST", "/v1/chat/completions", chat_body(steer=steer))
                assert head["status"] == 200 and head["vectors"] == ["calm"], body
                clamped = reply(httpx.Response(200, content=body))
                same(clamped, reply(ask(plain, "/v1/chat/completions", chat_body(steer=steer))))
                assert clamped[1] != pytest.approx(off[1], abs=1e-3)  # the bounds bite
    finally:
        forward.close()
        server.close()


def test_a_vector_that_cannot_load_is_a_server_error_naming_it(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    forward = InProcess("r1", tiny_chat_lm, "tiny", str(tmp_path))
    head, body = forward("POST", "/v1/chat/completions", chat_body(steer={"broken": 1.0}))
    forward.close()
    error = json.loads(body)["error"]
    assert head["status"] == 500 and error["code"] == "vector_load_failed" and error["param"] == "steer"
    assert "replica r1 could not load a control vector" in error["message"] and head["vectors"] == []


def test_nothing_loads_for_a_request_without_the_api_key(vector_dir):
    forward = InProcess("r2", tiny_chat_lm, "tiny", str(vector_dir), app_options={"api_keys": ["sesame"]})
    head, body = forward("POST", "/v1/chat/completions", chat_body(steer={"happy": 1.0}))
    assert head["status"] == 401 and head["vectors"] == []
    head, body = forward("POST", "/v1/chat/completions", chat_body(steer={"happy": 1.0}),
                         [(b"authorization", b"Bearer sesame")])
    assert head["status"] == 200 and head["vectors"] == ["happy"]
    forward.close()


def test_bad_vector_folders_and_replica_counts_are_refused_before_ray_starts(tmp_path):
    with pytest.raises(ValueError, match="vector_dir '.*nowhere' is not a folder; expected a folder of NAME.gguf"):
        ray_serve.serve_on_ray(tiny_chat_lm, vector_dir=tmp_path / "nowhere")
    (tmp_path / "not-a-name.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not-a-name.gguf: a vector's file name is its name in \"steer\""):
        ray_serve.serve_on_ray(tiny_chat_lm, vector_dir=tmp_path)
    with pytest.raises(ValueError, match=r"replicas \(--replicas\) must be an int >= 1, got 0"):
        ray_serve.serve_on_ray(tiny_chat_lm, 0)
    with pytest.raises(TypeError, match="model must be a preset name, a path or a callable returning a CausalLM, got int"):
        ray_serve.serve_on_ray(3)


def test_the_command_line_flags_reach_serve_on_ray(monkeypatch, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    ray_serve.add_arguments(parser)
    args = parser.parse_args(["--ray", "--replicas", "3", "--vector-dir", "vecs", "--ray-address", "auto"])
    calls = []
    monkeypatch.setattr(ray_serve, "serve_on_ray", lambda *a, **k: calls.append((a, k)) or "http://127.0.0.1:8000")
    monkeypatch.setattr(ray_serve, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray_serve.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    ray_serve.run_from_args(args, tiny_chat_lm, max_batch=4)
    assert calls == [((tiny_chat_lm, 3), dict(host="127.0.0.1", port=8000, vector_dir="vecs", model_name="m",
                                              address="auto", max_batch=4)), "shutdown"]
    assert "serving m on http://127.0.0.1:8000/v1 with 3 replicas" in capsys.readouterr().err


# -- two replicas on Ray ----------------------------------------------------------------------------


def _out_of_time(signum, frame):
    raise TimeoutError(f"the Ray scale-out test ran past {LIMIT_S} s (Ray start, two replicas, the requests)")


@pytest.fixture(scope="module")
def ray_url(vector_dir):
    """Two replicas of the tiny model on a local Ray instance, every vector loaded on demand; the
    whole module's Ray part must finish within LIMIT_S (SIGALRM fails the test running then)."""
    pytest.importorskip("ray.serve")
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(LIMIT_S)
    with pytest.MonkeyPatch.context() as env:
        # the replicas import the model factory (tests.serve_fixtures) by name: from this checkout
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        try:
            ray_serve._start_ray("local", 2)
        except Exception as e:  # noqa: BLE001 - a machine where Ray cannot run
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            pytest.skip(f"a local Ray instance could not start here: {type(e).__name__}: {e}")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield ray_serve.serve_on_ray(tiny_chat_lm, 2, port=port, vector_dir=vector_dir, model_name="tiny", max_batch=4)
    finally:
        ray_serve.shutdown()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.ray
def test_two_replicas_on_ray_answer_as_one_server_routing_by_vectors_and_conversation(ray_url, plain):
    started = time.perf_counter()
    client = httpx.Client(base_url=ray_url, timeout=60)
    health = client.get("/health")
    assert health.status_code == 200 and set(health.json()["replicas"]) == {"replica_0", "replica_1"}
    assert client.get("/v1/models").json()["data"][0]["control_vectors"] == ["formal", "happy"]

    # one at a time, the routes are fixed: a new vector goes to the replica holding fewer, a known
    # one to its holder, a conversation's next turn to the replica that served the turn before
    first = chat_body(steer={"happy": 1.5})
    steps = [first, chat_body(steer={"formal": -1.0}), chat_body([{"role": "user", "content": "Hi!"}], {"happy": 0.5}),
             chat_body(steer={"happy": 0.5, "formal": 1.0})]
    answers = [ask(client, "/v1/chat/completions", body) for body in steps]
    turn = QUESTION + [{"role": "assistant", "content": reply(answers[0])[0]}, {"role": "user", "content": "More?"}]
    steps.append(chat_body(turn, {"happy": 1.5}))
    answers.append(ask(client, "/v1/chat/completions", steps[-1]))
    assert [a.headers["x-kvwire-replica"] for a in answers] == ["replica_0", "replica_1", "replica_0", "replica_1",
                                                                  "replica_0"]
    assert answers[-1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the first turn's keys/values
    state = client.get("/kvwire/router").json()["replicas"]
    assert state["replica_0"]["loads"] == ["happy"] and state["replica_1"]["loads"] == ["formal", "happy"]
    for body, answer in zip(steps, answers):
        same(reply(answer), reply(ask(plain, "/v1/chat/completions", body)))

    # all at once, mixed: each answer as the plain server's, from a replica holding its vectors
    mixed = [("/v1/chat/completions", chat_body([{"role": "user", "content": f"Question {i}?"}], steer))
             for i, steer in enumerate([{}, {"happy": 1.5}, {"formal": -1.0}, {"happy": 0.5, "formal": 1.0},
                                        {"happy": -2.0}, {"formal": 0.0}, {"happy": 2.0}, None])]
    mixed.append(("/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, "temperature": 0, "logprobs": 0,
                                      "steer": {"formal": 1.0}}))
    with ThreadPoolExecutor(len(mixed)) as pool:
        together = list(pool.map(lambda m: ask(client, *m), mixed))
    for (path, body), answer in zip(mixed, together):
        same(reply(answer), reply(ask(plain, path, body)))
        wanted = {name for name, value in (body.get("steer") or {}).items() if value}
        assert wanted <= set(answer.headers["x-kvwire-vectors"].split(",")), (body, answer.headers)
    assert {a.headers["x-kvwire-replica"] for a in together} == {"replica_0", "replica_1"}

    # a stream through the router is the same answer, chunk by chunk
    streamed = chat_body(steer={"happy": -2.0}, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=streamed) as events:
        assert events.status_code == 200 and events.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and len(lines) > 3
    text = "".join(json.loads(line)["choices"][0]["delta"].get("content", "") for line in lines[:-1])
    assert text == reply(ask(plain, "/v1/chat/completions", chat_body(steer={"happy": -2.0})))[0]
    assert all(v["in_flight"] == 0 for v in client.get("/kvwire/router").json()["replicas"].values())
    assert client.get("/nowhere").status_code == 404
    print(f"requests through Ray: {time.perf_counter() - started:.1f} s")
