"""The HTTP API against OpenAI's spec where clients lean on it: nulls where the spec allows them,
fields kvwire cannot honour refused (never ignored), 405 answers naming the allowed methods, and a
`--max-length` past the model's context refused at start-up."""
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, tiny_chat_lm  # noqa: E402

HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm):
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=128))
    yield s
    s.close()


def _post(server, path, body):
    return httpx.post(f"{server.url}/v1/{path}", json=body)


def test_nulls_allowed_by_openais_spec_take_the_defaults(server):
    base = {"messages": HELLO, "max_tokens": 4, "temperature": 0}
    plain = _post(server, "chat/completions", base)
    nulls = _post(server, "chat/completions", {**base, "n": None, "stream": None, "logprobs": None,
                                                 "top_logprobs": None, "stop": None, "seed": None})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert len(nulls.json()["choices"]) == 1 and nulls.json()["choices"][0]["logprobs"] is None
    done = _post(server, "completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "n": None,
                                         "echo": None, "suffix": None, "best_of": None, "logprobs": None})
    assert done.status_code == 200, done.text


@pytest.mark.parametrize("field, value, message", [
    ("suffix", "and then", "suffix (insertion) is not supported"),
    ("best_of", 3, "best_of is not supported (only 1), got 3"),
    ("echo", True, "echo is not supported"),
])
def test_completion_fields_kvwire_cannot_honour_are_refused_not_ignored(server, field, value, message):
    response = _post(server, "completions", {"prompt": "Hello", "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and message in error["message"]


def test_best_of_one_is_the_plain_answer(server):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert _post(server, "completions", {**body, "best_of": 1}).json()["choices"][0]["text"] == \
        _post(server, "completions", body).json()["choices"][0]["text"]


def test_a_wrong_method_answers_405_with_allow(server):
    response = httpx.get(f"{server.url}/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["message"].startswith("GET /v1/chat/completions:")


def test_max_length_past_the_models_context_is_refused_at_start(lm):
    with pytest.raises(ValueError, match=r"max_length \(--max-length\) is 100000, more than the model's context of "
                                         r"256 tokens; expected at most 256"):
        create_app(lm, "tiny", max_length=100000)


@pytest.mark.parametrize("path, body, param", [
    ("completions", '{"prompt": "\\ud800 hi", "max_tokens": 2}', "prompt"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(server, path, body, param):
    response = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone surrogate U+D800" in error["message"]


def test_the_python_api_refuses_a_lone_surrogate_with_the_same_message(lm):
    from kvwire.generate.request import RequestError

    with pytest.raises(RequestError, match=r"^prompt holds a lone surrogate U\+D800 at character 0; expected valid"):
        lm.generate("\ud800 hi", max_new_tokens=2)
    with pytest.raises(RequestError, match=r"^messages\[0\]\.content holds a lone surrogate U\+D800 at character 1"):
        lm.chat([{"role": "user", "content": "a\ud800"}], max_new_tokens=2)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_valid_json_is_read_whatever_the_content_type(server, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    body = '{"prompt": "Hello", "max_tokens": 3, "temperature": 0}'
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 200, response.text
    want = _post(server, "completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert response.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]


def test_the_openapi_schema_documents_the_errors_the_server_sends(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    error = spec["components"]["schemas"]["Error"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)  # never sent: refusals are 400s
            assert responses["default"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "400" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    sent = _post(server, "chat/completions", {"messages": HELLO, "max_tokens": 0})
    body = sent.json()
    assert sent.status_code == 400 and set(body) == set(error["required"])
    assert set(body["error"]) == set(error["properties"]["error"]["required"])


@pytest.mark.parametrize("messages, param, message", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.org/a.png"}}]}],
     "messages[0].content", r"only text parts are supported \(the model reads text\); got parts of type \['image_url'\]"),
    # a tool result must answer a call made earlier in the conversation (tool calls: test_serve_tools.py)
    ([{"role": "tool", "content": "42", "tool_call_id": "1"}], "messages[0].tool_call_id", "'1'"),
])
def test_what_the_model_cannot_take_is_refused_naming_the_message(server, messages, param, message):
    import re

    response = _post(server, "chat/completions", {"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error


def test_a_template_refusal_does_not_show_where_the_template_was_read_from(tmp_path):
    from kvwire.io.chat_template import ChatTemplate

    origin = str(tmp_path / "secret" / "kvwire_chat.json")
    lm = tiny_chat_lm()  # its own model: the module's keeps its template
    lm.tokenizer.chat_template = ChatTemplate("{{ messages[0].missing.deeper }}", origin)
    s = Server(create_app(lm, "tiny", max_batch=1, max_length=128))
    try:
        response = _post(s, "chat/completions", {"messages": HELLO, "max_tokens": 2})
    finally:
        s.close()
    assert response.status_code == 400
    text = response.json()["error"]["message"]
    assert str(tmp_path) not in text and text.startswith("the model's chat template: rendering failed"), text
