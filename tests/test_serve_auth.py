"""Who may use a `kvwire serve` app: API keys on every endpoint but the open pages (each route of the
app is tried, so a new endpoint cannot slip past), CORS only for the origins named, and the
playground's training turned off. Tiny chat model over uvicorn on 127.0.0.1."""
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

KEYS = ["sk-first", "sk-second"]
HELLO = [{"role": "user", "content": "Hello there"}]
# what may be read without a key: GET of these paths (a mount: any file under it)
OPEN = {"/", "/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/static/x", "/docs-assets/x"}


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm):
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=96, control_vectors=control_vectors(lm),
                          api_keys=KEYS))
    yield s
    s.close()


def every_request(app):
    """(method, path) for each route of `app` and each of its methods (path parameters filled in)."""
    for route in app.routes:
        if isinstance(route, Mount):
            yield "GET", route.path + "/x"
            continue
        for method in sorted(route.methods - {"HEAD"}):
            path = route.path.replace("{file}", "happy.gguf")
            yield method, re.sub(r"\{[^}]+\}", "x", path)


def send(server, method, path, key=None, authorization=None):
    headers = {"Authorization": authorization or f"Bearer {key}"} if key or authorization else {}
    body = {"json": {}} if method == "POST" else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **body)


def refused(response):
    assert response.status_code == 401, (response.request.url, response.status_code)
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["param"] is None
    return error["message"]


def test_every_endpoint_but_the_open_pages_needs_a_key(server):
    requests = sorted(set(every_request(server.app)))
    paths = {p for _, p in requests}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/kvwire/train"} <= paths
    assert {p for m, p in requests if m == "GET"} >= OPEN
    for method, path in requests:
        if method == "GET" and path in OPEN:
            assert send(server, method, path).status_code != 401, path
            continue
        assert refused(send(server, method, path)).startswith("no API key: this server needs one, sent as "
                                                               "'Authorization: Bearer KEY'")
        assert refused(send(server, method, path, key="sk-wrong")).startswith("incorrect API key provided")
        assert refused(send(server, method, path, authorization=f"Basic {KEYS[0]}")).startswith("incorrect API key")
        assert send(server, method, path, key=KEYS[1]).status_code != 401, path
    # paths no route takes, and other methods on the open ones, need the key too
    refused(send(server, "GET", "/no/such/page"))
    refused(send(server, "POST", "/health"))


def test_the_right_key_opens_the_api(server):
    for key in KEYS:
        assert send(server, "GET", "/v1/models", key=key).json()["data"][0]["id"] == "tiny"
        assert send(server, "GET", "/kvwire/info", key=key).status_code == 200
        assert send(server, "GET", "/metrics", key=key).text.startswith("# HELP")
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3},
                        headers={"authorization": f"bearer {KEYS[0]}"}, timeout=60)  # the scheme in any case
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def test_the_open_pages_need_no_key(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert 'src="/static/app.js"' in httpx.get(f"{server.url}/").text
    assert "Bearer" in httpx.get(f"{server.url}/static/api.js").text  # the page sends the key it is given
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert spec["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": "one of the server's --api-key values"}
    assert "401" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert httpx.get(f"{server.url}/docs").status_code == 200
    from kvwire.serve.auth import is_open

    assert not is_open("GET", "/static/../metrics") and not is_open("POST", "/static/app.js")


def test_the_openai_client_with_its_api_key(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason is not None  # the stream went through the middleware
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key provided"):
        wrong.models.list()
    assert client.models.list().data[0].id == "tiny"  # still serving


def test_keys_no_client_can_send_are_refused_at_start(lm):
    for keys, shown in (([], "api_keys is empty"), ([""], "a key of 0 characters"), (["a b"], "a key of 3"),
                        (["ключ"], "a key of 4"), ([7], "got a int")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            create_app(lm, "tiny", max_length=64, api_keys=keys)


def test_the_serve_command_reads_keys_from_flags_and_the_environment(monkeypatch):
    from kvwire.cli import parser
    from kvwire.cli.serve import api_keys
    from kvwire.kernels import switches

    monkeypatch.delenv("KVWIRE_API_KEYS", raising=False)
    assert api_keys(parser().parse_args(["serve"])) is None
    args = parser().parse_args(["serve", "--api-key", "a1", "--api-key", "b2", "--cors-origin", "http://x.example",
                                "--no-playground-training"])
    assert api_keys(args) == ["a1", "b2"]
    assert args.cors_origin == ["http://x.example"] and args.playground_training is False
    assert parser().parse_args(["serve"]).playground_training is True
    monkeypatch.setenv("KVWIRE_API_KEYS", " c3, d4 ,")
    assert api_keys(args) == ["a1", "b2", "c3", "d4"]
    assert switches.current()["KVWIRE_API_KEYS"]["value"] == "(hidden)"  # `kvwire info`: set, never what it holds
    monkeypatch.setenv("KVWIRE_API_KEYS", ",")  # set, but no key: refused later, not an open server
    assert api_keys(parser().parse_args(["serve"])) == [""]
    assert api_keys(parser().parse_args(["serve", "--api-key", ""])) == ["", ""]


def test_cors_is_off_unless_an_origin_is_named(lm, server):
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    closed = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in closed.headers
    assert "access-control-allow-origin" not in httpx.get(f"{server.url}/health",
                                                          headers={"Origin": "http://page.example"}).headers
    app = create_app(lm, "tiny", max_length=64, api_keys=KEYS, cors_origins=["http://page.example"])
    with TestClient(app) as client:
        allowed = client.options("/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://page.example"
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = client.options("/v1/chat/completions", headers={**preflight, "Origin": "http://else.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        models = client.get("/v1/models", headers={"Origin": "http://page.example",
                                                   "Authorization": f"Bearer {KEYS[0]}"})
        assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "http://page.example"
        # a refusal carries the header too, so the page can read why
        assert client.get("/v1/models", headers={"Origin": "http://page.example"}).headers[
            "access-control-allow-origin"] == "http://page.example"


def test_training_and_sweeps_can_be_turned_off(lm):
    app = create_app(lm, "tiny", max_length=64, control_vectors=control_vectors(lm), playground_training=False)
    pairs = dict(positive=["I am happy"], negative=["I am sad"])
    with TestClient(app) as client:
        for path, body in (("/kvwire/train", {"name": "joy", **pairs}), ("/kvwire/train", {"bad": 1}),
                           ("/kvwire/sweep", {"vector": "happy", "strengths": [0, 1]})):
            answer = client.post(path, json=body)
            assert answer.status_code == 403, answer.json()
            error = answer.json()["error"]
            assert error["code"] == "training_disabled" and "--no-playground-training" in error["message"]
        assert client.get("/kvwire/info").json()["training"] is False
        assert [v["name"] for v in client.get("/kvwire/vectors").json()["data"]] == ["happy", "formal"]
        download = client.get("/kvwire/vectors/happy.gguf")
        assert download.status_code == 200 and download.content[:4] == b"GGUF"
        chat = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
        assert chat.status_code == 200
        assert "joy" not in app.state.served.vectors
