"""Structured outputs over HTTP: `response_format` (json_object, json_schema, and kvwire's regex and
grammar) through the official openai client, whole and streamed; constrained and free requests in
one batch give what each gives alone; what cannot be compiled is a 400 naming the part."""
import asyncio
import json
import re

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, tiny_chat_lm  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "Who is Ada?"}]


@pytest.fixture(scope="module")
def server():
    s = Server(create_app(tiny_chat_lm(), "tiny", max_batch=4, max_length=256))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def valid_or_prefix(text, reason, schema):
    if reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert reason == "length" and text.startswith("{")


def test_json_schema_answers_are_valid(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, temperature=1.0, seed=seed,
                                           response_format=schema_format(PERSON))
        choice = r.choices[0]
        valid_or_prefix(choice.message.content, choice.finish_reason, PERSON)
        assert choice.finish_reason == "stop"  # the tiny model finishes a small object within 120 tokens


def test_the_clients_parse_helper_gets_a_pydantic_object(client):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    r = client.chat.completions.parse(model="tiny", messages=USER, max_tokens=120, response_format=Point)
    assert isinstance(r.choices[0].message.parsed, Point)


def test_json_object_regex_and_grammar(client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="tiny", prompt="Call", max_tokens=20,
                                  extra_body={"response_format": {"type": "regex", "regex": r"\+[0-9]{2} [0-9]{4}"}})
    assert re.fullmatch(r"\+[0-9]{2} [0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="Answer", max_tokens=20, extra_body={
        "response_format": {"type": "grammar", "grammar": 'root ::= ("yes" | "no") "."'}})
    assert r.choices[0].text in ("yes.", "no.")


def test_streamed_pieces_add_up_to_a_valid_answer(client):
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, stream=True,
                                            response_format=schema_format(PERSON))
    pieces, reason = [], None
    for chunk in stream:
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reason = c.finish_reason or reason
    valid_or_prefix("".join(pieces), reason, PERSON)


def test_mixed_constrained_and_free_requests_equal_each_alone(server, client):
    """Concurrent requests with different response formats (and none) share the engine's batch;
    each answer (greedy) is the one it gets alone."""
    bodies = [dict(response_format=schema_format(PERSON)), {}, dict(response_format={"type": "json_object"}),
              dict(extra_body={"response_format": {"type": "regex", "regex": "[a-z]{3,8}"}}), {}]
    alone = [client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0, **b)
             .choices[0].message.content for b in bodies]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def together():
        rs = await asyncio.gather(*(aclient.chat.completions.create(model="tiny", messages=USER, max_tokens=40,
                                                                     temperature=0, **b) for b in bodies))
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == alone
    assert alone[1] != alone[0]


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "json_schema"}, "response_format.json_schema.schema", "is required"),
    (schema_format({"type": "wat"}), "response_format.json_schema.schema", "Invalid type: wat"),
    (schema_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "response_format.json_schema.schema", "nowhere"),
    ({"type": "regex", "regex": "(unclosed"}, "response_format.regex", "cannot be compiled"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "response_format.grammar", "unknown name"),
    ({"type": "xml"}, "response_format.type", "input should be"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "response_format.json_schema.name",
     "pattern"),
])
def test_what_cannot_be_compiled_is_a_400_naming_the_part(client, fmt, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, response_format=fmt)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices  # still serving


def test_stop_with_a_format_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="grammar decides"):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, stop=["}"],
                                       response_format={"type": "json_object"})
