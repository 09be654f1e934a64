"""`kvwire serve`'s app: OpenAI's API over the engine, driven by the official openai client and httpx
against uvicorn on 127.0.0.1 (tiny random chat model, two control vectors)."""
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

MAX_LENGTH = 128
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm):
    app = create_app(lm, "tiny", max_batch=2, max_length=MAX_LENGTH, control_vectors=control_vectors(lm))
    s = Server(app)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat(client, messages=HELLO, max_tokens=8, **options):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=max_tokens,
                                          **options)


def streamed(client, **options):
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons, chunks


def test_greedy_streamed_equals_whole_equals_lm_chat(lm, client):
    expected = lm.chat(HELLO, max_new_tokens=8, reuse_prefix=False)
    whole = chat(client)
    text, reasons, chunks = streamed(client)
    assert whole.choices[0].message.content == text == expected
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].finish_reason == "length" and reasons == ["length"]
    assert whole.usage.completion_tokens == 8 and whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_logprobs_whole_and_streamed(client):
    whole = chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    _, _, chunks = streamed(client, logprobs=True, top_logprobs=2)
    parts = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(whole) == 8 and [e.model_dump() for e in parts] == [e.model_dump() for e in whole]
    for e in whole:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob
        assert e.bytes == list(e.token.encode("utf-8"))


def test_completions_list_of_prompts_with_n_and_logprobs(lm, client):
    out = client.completions.create(model="tiny", prompt=["Once upon", "a time"], temperature=0, max_tokens=6,
                                    n=2, logprobs=1)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and len(out.choices) == 4
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] == lm.generate("Once upon", max_new_tokens=6)
    assert texts[2] == texts[3] == lm.generate("a time", max_new_tokens=6)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6 and len(lp.top_logprobs[0]) == 1
    assert out.usage.prompt_tokens == len(lm.tokenizer.encode("Once upon")) + len(lm.tokenizer.encode("a time"))
    assert out.usage.completion_tokens == 24
    pieces = client.completions.create(model="tiny", prompt="Once upon", temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == texts[0]


def test_stop_strings_end_the_text_streamed_and_whole(lm, client):
    full = chat(client, max_tokens=12).choices[0].message.content
    stop = full[4:6]
    expected = full[:full.find(stop)]
    whole = chat(client, max_tokens=12, stop=[stop, "never appears"])
    text, reasons, _ = streamed(client, max_tokens=12, stop=stop)
    assert whole.choices[0].message.content == text == expected
    assert whole.choices[0].finish_reason == "stop" and reasons == ["stop"]


def test_steering_concurrent_equals_one_at_a_time_and_changes_the_reply(client):
    choices = [{}, {"happy": 1.5}, {"formal": -1.0}, {"happy": 0.5, "formal": 1.0}, {"happy": 0.0}, {"happy": -2.0}]

    def ask(steer):  # text, and the chosen tokens' log-probabilities (random bytes decode alike to U+FFFD)
        choice = chat(client, logprobs=True, extra_body={"steer": steer}).choices[0]
        return choice.message.content, [e.logprob for e in choice.logprobs.content]

    alone = [ask(s) for s in choices]
    with ThreadPoolExecutor(len(choices)) as pool:  # more requests than the server's 2 slots, one batch
        together = list(pool.map(ask, choices))
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(together, alone):
        assert a == pytest.approx(b, abs=1e-4)
    assert alone[4] == alone[0]  # strength 0 is no steering
    for i in range(4):
        for j in range(i):
            assert max(abs(x - y) for x, y in zip(alone[i][1], alone[j][1])) > 1e-2, (i, j)


def test_more_requests_than_slots_all_complete(client):
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(7)]
    alone = [chat(client, m, max_tokens=5).choices[0].message.content for m in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda m: chat(client, m, max_tokens=5), prompts))
    assert [r.choices[0].message.content for r in together] == alone
    assert all(r.usage.completion_tokens == 5 for r in together)


def test_second_turn_reuses_the_first(client):
    first = [{"role": "user", "content": "Tell me about the sea, please."}]
    reply = chat(client, first)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And the mountains?"}]
    again = chat(client, second)
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens


def test_dropped_stream_cancels_its_row_and_others_go_on(server, client, caplog):
    other = [{"role": "user", "content": "Keep going while the other one leaves."}]
    expected = chat(client, other, max_tokens=40).choices[0].message.content
    caplog.set_level(logging.INFO, logger="kvwire.serve")
    results = []
    worker = threading.Thread(target=lambda: results.append(chat(client, other, max_tokens=40)))
    body = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 80, "stream": True}
    with httpx.Client(base_url=server.url) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            worker.start()
            lines = response.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
        # leaving the block closes the connection mid-stream
    worker.join(30)
    assert results and results[0].choices[0].message.content == expected
    for _ in range(100):
        if any("finish cancelled" in r.getMessage() for r in caplog.records):
            break
        threading.Event().wait(0.05)
    cancelled = [r.getMessage() for r in caplog.records if "finish cancelled" in r.getMessage()]
    assert len(cancelled) == 1 and "completion 80 tokens" not in cancelled[0]
    assert chat(client, other, max_tokens=40).choices[0].message.content == expected
    assert httpx.get(server.url + "/health").json()["running"] == 0


def test_client_leaving_a_whole_request_cancels_it(server, client, caplog):
    caplog.set_level(logging.INFO, logger="kvwire.serve")
    body = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 80}
    with pytest.raises(httpx.TimeoutException):  # 80 tokens take far longer than 50 ms
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.05)
    for _ in range(100):
        if any("finish cancelled" in r.getMessage() for r in caplog.records):
            break
        threading.Event().wait(0.05)
    cancelled = [r.getMessage() for r in caplog.records if "finish cancelled" in r.getMessage()]
    assert len(cancelled) == 1 and "completion 80 tokens" not in cancelled[0]
    assert chat(client).choices[0].finish_reason == "length"


def test_failing_row_answers_with_an_error_and_others_go_on(client):
    expected = chat(client).choices[0].message.content
    with pytest.raises(openai.InternalServerError, match="non-finite logits"):
        chat(client, extra_body={"steer": {"happy": 1e38}})  # the steered hidden states overflow
    with pytest.raises(openai.APIError, match="non-finite logits"):
        list(chat(client, stream=True, extra_body={"steer": {"happy": 1e38}}))
    assert chat(client).choices[0].message.content == expected


LONG = "word " * 200
BAD = [  # (endpoint, body, status, param, message pattern)
    ("chat", {"messages": HELLO, "model": "gpt-4"}, 404, "model", "model 'gpt-4' is not served here"),
    ("chat", {"messages": []}, 400, "messages", "messages is empty"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "unknown role robot"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "messages", "role.*must be a str"),
    ("chat", {"messages": HELLO, "temperature": -1}, 400, "temperature", "temperature must be .* >= 0"),
    ("chat", {"messages": HELLO, "top_p": 0}, 400, "top_p", r"top_p must lie in \(0, 1\]"),
    ("chat", {"messages": HELLO, "top_p": 1.5}, 400, "top_p", r"top_p must lie in \(0, 1\]"),
    ("chat", {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an int >= 1, got 0"),
    ("chat", {"messages": HELLO, "max_completion_tokens": -3}, 400, "max_completion_tokens", "max_completion_tokens must be an int >= 1, got -3"),
    ("chat", {"messages": HELLO, "max_tokens": 500}, 400, "max_tokens", "at most .* new tokens fit"),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "prompt has .* tokens, but"),
    ("completions", {"prompt": LONG}, 400, "prompt", "prompt has 1000 tokens, but this server's context is 128"),
    ("completions", {"prompt": ""}, 400, "prompt", "non-empty str"),
    ("chat", {"messages": HELLO, "steer": {"sad": 1.0}}, 400, "steer", r"unknown control vector names \['sad'\]"),
    ("chat", {"messages": HELLO, "steer": {"happy": "lots"}}, 400, "steer.happy", "should be a number"),
    ("chat", {"messages": HELLO, "steer": {"happy": 1e39}}, 400, "steer.happy", "finite float32"),
    ("chat", {"messages": HELLO, "steer": [1]}, 400, "steer", "valid dictionary"),
    ("chat", {"messages": "hi"}, 400, "messages", "valid list"),
    ("chat", {"messages": HELLO, "temperature": "hot"}, 400, "temperature", "should be a number"),
    ("chat", {"messages": HELLO, "n": True}, 400, "n", "valid integer"),
    ("chat", {"messages": HELLO, "n": 0}, 400, "n", "n must be an int >= 1, got 0"),
    ("chat", {"messages": HELLO, "stop": 3}, 400, "stop", "valid string"),
    ("chat", {"messages": HELLO, "stop": [""]}, 400, "stop", "non-empty"),
    ("chat", {"messages": HELLO, "top_logprobs": 3}, 400, "top_logprobs", "needs logprobs=true"),
    ("chat", {"messages": HELLO, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("chat", {}, 400, "messages", "messages is required"),
    ("completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs", r"logprobs must be an int in \[0, 5\]"),
]


@pytest.mark.parametrize("endpoint, body, status, param, message", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_answered_in_openai_shape(server, endpoint, body, status, param, message):
    response = httpx.post(f"{server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_malformed_json_and_non_object_bodies(server, client):
    for content, pattern in [(b"{bad", "not valid JSON"), (b"[1, 2]", "must be a JSON object")]:
        response = httpx.post(server.url + "/v1/chat/completions", content=content,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and pattern in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.chat.completions.create(model="tiny", messages=HELLO, temperature=-0.5)
    unknown = httpx.get(server.url + "/v1/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "GET /v1/nothing: Not Found"
    assert chat(client).choices[0].finish_reason == "length"  # still serving


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "kvwire"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["control_vectors"] == ["formal", "happy"] and card["max_length"] == MAX_LENGTH
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "tiny", "waiting": 0, "running": 0}


def test_app_refuses_bad_control_vector_names_and_models_without_tokenizer(lm):
    vec = control_vectors(lm)["happy"]
    with pytest.raises(ValueError, match="control vector name 'not-a-name' is not a Python identifier"):
        create_app(lm, control_vectors={"not-a-name": vec})
    with pytest.raises(ValueError, match="control vector name 'class' is not a Python identifier"):
        create_app(lm, control_vectors={"class": vec})
    tokenizer, lm.tokenizer = lm.tokenizer, None
    try:
        with pytest.raises(ValueError, match="the served model has no tokenizer"):
            create_app(lm)
    finally:
        lm.tokenizer = tokenizer
