"""The playground's /kvwire/ endpoints over httpx (tiny chat model): a vector trained while a stream
runs joins the served model without touching that stream (the engine drains, then swaps), and
refusals come in OpenAI's error shape."""
import inspect
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvwire as kw  # noqa: E402
from kvwire.graph.trace import LayerTracer  # noqa: E402
from kvwire.serve import create_app  # noqa: E402
from kvwire.serve.playground import TrainRequest  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

PAIRS = dict(positive=["I am so happy today", "What a wonderful surprise"],
             negative=["I am so sad today", "What a terrible surprise"])


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm):
    s = Server(create_app(lm, "tiny", max_batch=4, max_length=128, control_vectors=control_vectors(lm)))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def finish(api, job):
    deadline = time.monotonic() + 120
    while job["state"] not in ("done", "error"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = api.get(f"/kvwire/jobs/{job['id']}").json()
    return job


def test_training_during_a_stream_swaps_after_it(lm, server, api):
    vectors = control_vectors(lm)
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "steer": {"happy": 0.5}}
    pieces, first = [], threading.Event()

    def stream():
        with api.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(line)
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    job = api.post("/kvwire/train", json={"name": "joy", **PAIRS, "layers": "1-2", "method": "mean_diff"})
    assert job.status_code == 202 and job.json()["state"] == "queued"
    job = finish(api, job.json())
    assert job["state"] == "done" and job["vector"]["layers"] == [1, 2] and job["vector"]["method"] == "mean_diff"
    joy = api.post("/v1/completions", json={**body, "max_tokens": 6, "steer": {"joy": 3.0}}).json()
    reader.join(600)
    assert not reader.is_alive()
    events = [json.loads(p[6:]) for p in pieces]
    assert all("choices" in e for e in events), events  # an error event names what failed
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == lm.steer(vectors["happy"], 0.5).generate(body["prompt"], max_new_tokens=24)
    trained = server.app.state.served.vectors["joy"]
    assert trained == kw.ControlVector.train(lm, PAIRS["positive"], PAIRS["negative"], layers="1-2",
                                             method="mean_diff", progress=False)
    assert joy["choices"][0]["text"] == lm.steer(trained, 3.0).generate(body["prompt"], max_new_tokens=6)
    assert server.app.state.bridge.swaps == 1
    assert "joy" in api.get("/v1/models/tiny").json()["control_vectors"]
    assert [v["name"] for v in api.get("/kvwire/vectors").json()["data"]] == ["happy", "formal", "joy"]
    graph = api.get("/kvwire/graph")
    assert graph.status_code == 200, graph.json()  # 503 names what is missing (Graphviz's `dot`)
    graph = graph.json()
    assert sorted(n for n, v in graph["steer_nodes"].items() if v == "joy") == ["layers_1__steer_2", "layers_2__steer_1"]
    assert graph["svg"].count("#ffb347") == 6 + 4  # every Steer layer orange, and the inline bank's layer per block


@pytest.mark.parametrize("method, path, body, status, message", [
    ("get", "/kvwire/vectors/sad.gguf", None, 404, "no control vector named 'sad'; loaded: happy, formal"),
    ("get", "/kvwire/jobs/nope", None, 404, "no training job 'nope'"),
    ("post", "/kvwire/train", {"name": "x", **PAIRS, "epochs": 3}, 400, "epochs: extra inputs are not permitted"),
    ("post", "/kvwire/train", {"name": "class", **PAIRS}, 400, "control vector name 'class' is not a Python identifier"),
    ("post", "/kvwire/train", {"name": "x", **PAIRS, "site": "mlp"}, 400, "site must be one of ['resid_pre', "),
    ("post", "/kvwire/train", {"name": "x", **PAIRS, "operation": "scale"}, 400,
     "operation must be one of ['add', 'ablate', 'clamp'], got 'scale'"),
    ("post", "/kvwire/train", {"name": "x", **PAIRS, "method": "svd"}, 400,
     "method must be one of ['pca_diff', 'pca_center', 'mean_diff', 'caa', 'logistic'], got 'svd'"),
    ("post", "/kvwire/train", {"name": "x", "positive": ["a", ""], "negative": ["b", "c"]}, 400,
     "positive must contain only non-empty str"),
    ("post", "/kvwire/sweep", {"vector": "happy", "strengths": ["1"]}, 400, "strengths.0: input should be a number"),
    ("post", "/kvwire/sweep", {"vector": "sad", "strengths": [1]}, 404, "no control vector named 'sad'"),
    ("post", "/kvwire/sweep", {"vector": "happy", "strengths": [1], "max_tokens": 0}, 400,
     "max_tokens must lie in [1, 256], got 0"),
])
def test_refusals(api, method, path, body, status, message):
    r = getattr(api, method)(path, **({} if body is None else {"json": body}))
    assert r.status_code == status and message in r.json()["error"]["message"], r.json()


def test_page_and_static_files_are_served(api):
    page = api.get("/")
    assert page.status_code == 200 and 'src="/static/app.js"' in page.text
    for name in ("app.js", "api.js", "play.js", "train.js", "graph.js", "sweep.js", "evaluate.js", "chart.js", "snippet.js",
                 "style.css"):
        assert api.get(f"/static/{name}").status_code == 200, name
    assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing from the network


def test_requests_trace_only_while_the_engine_is_held(server, api, monkeypatch):
    """torch.fx patches nn.Module.__call__ process-wide while it traces, so a trace that a request runs
    outside the gate breaks whatever step runs meanwhile (a stream once failed so under load, when
    a training request's check traced the backbone on the event loop)."""
    gate, unguarded = server.app.state.bridge.gate, []
    original = LayerTracer.trace

    def watched(self, *args, **kwargs):
        here = threading.current_thread()
        if here is not threading.main_thread() and here.name != "kvwire-engine" and gate.holder != here.ident:
            unguarded.append(here.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LayerTracer, "trace", watched)
    assert api.get("/kvwire/info").json()["blocks"] == [0, 1, 2, 3]
    refused = api.post("/kvwire/train", json={"name": "x", **PAIRS, "layers": "7"})
    assert refused.status_code == 400 and "layers" == refused.json()["error"]["param"]
    job = finish(api, api.post("/kvwire/train", json={"name": "calm", **PAIRS, "layers": "2"}).json())
    assert job["state"] == "done", job
    assert api.get("/kvwire/graph").status_code == 200
    assert unguarded == []


def test_training_defaults_to_the_librarys_method(api):
    default = inspect.signature(kw.ControlVector.train).parameters["method"].default
    info = api.get("/kvwire/info").json()
    assert info["default_method"] == default and default in info["methods"]
    assert TrainRequest(name="x", **PAIRS).method == default


def test_a_vector_trained_at_the_heads_site_is_served_there(lm, api):
    assert "attn_heads" in api.get("/kvwire/info").json()["sites"]
    job = finish(api, api.post("/kvwire/train", json={"name": "heads", **PAIRS, "layers": "1-2",
                                                       "site": "attn_heads"}).json())
    assert job["state"] == "done", job
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    steered = api.post("/v1/completions", json={**body, "steer": {"heads": 6.0}}).json()["choices"][0]["text"]
    vec = kw.ControlVector.train(lm, PAIRS["positive"], PAIRS["negative"], layers="1-2", site="attn_heads",
                                 progress=False)
    assert vec.width == lm.backbone.layers[1].self_attn.site_width("attn_heads")
    assert steered == lm.steer(vec, 6.0).generate("Once upon a time", max_new_tokens=8)
    assert steered != api.post("/v1/completions", json=body).json()["choices"][0]["text"]
