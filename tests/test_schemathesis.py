"""`kvwire serve`'s app fuzzed from its own OpenAPI schema (schemathesis): schema-valid requests to
every operation, each answer checked for no 5xx, a documented status, content type and body shape.
A schema-valid request may rightly be refused (a prompt past the context); that is not a failure.
Tiny random chat model; at most 8 new tokens a request (--max-tokens), so every accepted request
generates a few tokens."""
import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402
from schemathesis import checks  # noqa: E402

from kvwire.serve import create_app  # noqa: E402
from kvwire.serve.limits import Limits  # noqa: E402

from .serve_fixtures import control_vectors, tiny_chat_lm  # noqa: E402

# Half the generation requests keep the fields schemathesis chose but take values this server
# accepts (no field it refuses on sight, chat messages its template takes, served steer names, small
# budgets), so that sampling, n, stop, stream, logprobs and steering reach the engine and its answers
# are checked too, not only the first field's refusal.
REFUSED_ON_SIGHT = ("model", "frequency_penalty", "presence_penalty", "logit_bias", "echo", "suffix", "best_of")
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "noop"}}]
FORMATS = [{"type": "text"}, {"type": "json_object"}, {"type": "regex", "regex": "[a-z]{1,6}"},
           {"type": "grammar", "grammar": 'start: "yes" | "no"'},
           {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}]
TEXT = st.text(min_size=1, max_size=12)
ACCEPTED = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=12)}), min_size=1, max_size=2),
    "prompt": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3)),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "seed": st.integers(0, 2**31),
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "n": st.integers(1, 3),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=2)),
    "steer": st.dictionaries(st.sampled_from(["happy", "formal"]), st.floats(-4, 4)),
    "response_format": st.sampled_from(FORMATS),
    "tools": st.sampled_from([TOOLS, TOOLS[:1]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "noop"}}]),
}
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
EXAMPLES = 100  # across all operations, half streamed; about 20 s on two cores
MAX_LENGTH = 1024  # prompt + completion: room for a tool-schema system prompt (~500 byte tokens)
MAX_TOKENS = 8  # --max-tokens: short generations whatever a request asks (more is refused)
GENERATION = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def client():
    import torch

    # one thread, as under pytest-xdist: two would share two cores with the engine's and the
    # client's threads, and on a busy machine a 60-token answer then takes tens of seconds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lm = tiny_chat_lm(MAX_LENGTH)
    app = create_app(lm, "tiny", max_batch=2, max_length=MAX_LENGTH, control_vectors=control_vectors(lm),
                     limits=Limits(max_tokens=MAX_TOKENS))
    with TestClient(app, raise_server_exceptions=False) as c:  # the context runs the engine's thread
        yield c
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def schema(client):
    # read through the running app; schemathesis' own ASGI loader would start a second lifespan (a
    # second engine thread over the same queues)
    return schemathesis.openapi.from_dict(client.get("/openapi.json").json())


# Once found by this test, now fixed, each kept as a case of its own: a positive temperature that
# float32 rounds to 0 (1e-300, 5e-324) answered 500; streamed answers (text/event-stream) and the
# GGUF download (application/octet-stream) were missing from the schema.


@pytest.mark.parametrize("stream", [False, True])
@settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: hundreds more requests
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schema_valid_requests_get_documented_answers(schema, client, stream, data):
    # every operation, and as often again the two generation endpoints
    case = data.draw(st.one_of(schema.as_strategy(), *(schema[path]["POST"].as_strategy() for path in GENERATION)))
    if isinstance(case.body, dict) and case.path in GENERATION:
        body = plausible(case.body, data) if data.draw(st.booleans()) else dict(case.body)
        if stream:
            body["stream"] = True
        elif body.get("stream"):  # schemathesis' true becomes false; its null or no field stays
            body["stream"] = False
        case.body = body
    answered(case, client)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tool_and_structured_output_requests_get_documented_answers(schema, client, data):
    """The agents' fields on every chat request: tools, tool_choice and response_format, as
    schemathesis draws them from the schema (mostly refused: random schemas, unknown tool names) or as
    this server takes them (so forced calls and constrained rows run), with the other fields plausible."""
    case = data.draw(schema["/v1/chat/completions"]["POST"].as_strategy())
    if not isinstance(case.body, dict):
        return answered(case, client)
    body = plausible(case.body, data)
    for field in ("tools", "tool_choice", "response_format"):
        if data.draw(st.booleans()):
            body[field] = data.draw(ACCEPTED[field])
    if body.get("tool_choice") not in (None, "auto", "none") or body.get("response_format", {}).get("type", "text") \
            != "text":
        body.pop("stop", None)  # refused with a constraint: keep the rest reaching the engine
    body["stream"] = data.draw(st.booleans())
    case.body = body
    answered(case, client)
    assert client.get("/health").status_code == 200  # still serving


def test_tiny_temperature_is_not_a_server_error(schema, client):
    body = {"prompt": "Once upon", "temperature": 1e-300, "max_tokens": 4}
    answered(schema["/v1/completions"]["POST"].Case(body=body, media_type="application/json"), client)


def test_vector_download_is_documented(schema, client):
    # a served vector's name: random path parameters never hit one
    answered(schema["/kvwire/vectors/{file}"]["GET"].Case(path_parameters={"file": "happy.gguf"}), client)


def answered(case, client):
    """Send `case` to the app and check the answer with CHECKS; a single failure is raised as itself
    (so that an xfail can name its kind), several as schemathesis' group."""
    sent = case.as_transport_kwargs(base_url=str(client.base_url))  # requests' keywords; the schema has no cookies
    response = client.request(sent["method"], sent["url"], params=sent.get("params"), headers=sent.get("headers"),
                              json=sent.get("json"), content=sent.get("data"))
    try:
        case.validate_response(response, checks=CHECKS)
    except BaseExceptionGroup as found:
        if len(found.exceptions) == 1:
            raise found.exceptions[0] from found
        raise


def plausible(body, data):
    """`body` without the fields refused on sight, the others (as chosen) with values this server takes."""
    body = {k: v for k, v in body.items() if k not in REFUSED_ON_SIGHT}
    for field in [f for f in ACCEPTED if f in body]:  # in a fixed order: the draws stay reproducible
        body[field] = data.draw(ACCEPTED[field])
    if "messages" in body:  # chat: logprobs is a bool, top_logprobs needs it
        body.pop("top_logprobs", None) if not body.get("logprobs") else body.update(top_logprobs=data.draw(
            st.integers(0, 5)))
    elif "logprobs" in body:
        body["logprobs"] = data.draw(st.integers(0, 5))
    return body
