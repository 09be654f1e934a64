"""Tool calls over HTTP: `tools` and `tool_choice` through the official openai client, whole and
streamed, on a ChatML template without tool support (kvwire's fallback convention) and on a
Hermes-style template that renders tools itself (the prompt equal to what transformers renders);
forced calls valid against their schemas; an agent framework's tool loop; bad tool requests as 400s."""
import json
import re
from typing import Literal

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import kvwire as kw  # noqa: E402
from kvwire.io.chat_template import ChatTemplate  # noqa: E402
from kvwire.io.tokenizer import Tokenizer  # noqa: E402
from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, backend, tiny_chat_hf, tiny_chat_lm  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 3}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": CITY, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NEW = 400  # byte tokens: a call with its markup is ~60, a random model wanders in whitespace

# a Hermes / Qwen 2.5-style template: tools rendered in the system turn, calls as <tool_call> JSON
HERMES = ("{%- if tools %}<|im_start|>system\nYou may call functions. <tools>\n{%- for t in tools %}\n{{ t | tojson }}"
          "{%- endfor %}\n</tools>\nAnswer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n"
          "{%- endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
          "{{ m.content }}\n</tool_response><|im_end|>\n{%- elif m.role == 'assistant' and m.tool_calls %}"
          "<|im_start|>assistant\n{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
          "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- else %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def hermes_lm():
    """The tiny chat model with <tool_call> and </tool_call> as added tokens and the Hermes template."""
    b = backend()
    b.add_tokens(["<tool_call>", "</tool_call>"])  # ids 258, 259: the model's spare ids
    lm = kw.from_hf(tiny_chat_hf(4096))
    lm.tokenizer = Tokenizer(b, eos_token_ids=[b.token_to_id("<|im_end|>")], chat_template=ChatTemplate(HERMES))
    return lm


@pytest.fixture(scope="module", params=["fallback", "hermes"])
def served(request):
    lm = tiny_chat_lm(4096) if request.param == "fallback" else hermes_lm()
    server = Server(create_app(lm, "tiny", max_batch=4, max_length=4096))
    yield request.param, lm, server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls):
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_choices_give_valid_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=NEW, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content is None
        check_calls(choice.message.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, max_tokens=NEW)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    check_calls(calls)


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=NEW, temperature=1.0, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_calls_add_up_to_the_whole_answer(client):
    """Greedy: the stream's tool-call deltas, joined as the openai client's users join them, are the
    calls of the same request answered whole (ids aside). One call: greedy, a random model would
    repeat its call until the budget ends."""
    one = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_tokens=NEW, temperature=0)
    whole = client.chat.completions.create(**one)
    calls, reason = {}, None
    for chunk in client.chat.completions.create(**one, stream=True):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or "" if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_a_tool_result_is_rendered_into_the_next_turn(client, served):
    name, lm, _ = served
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    short = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=1)
    long = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=1)
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + len("sunny, 21 C")


def test_the_native_prompt_is_what_transformers_renders(served):
    """Hermes template: kvwire renders tools, a call and its result as transformers'
    apply_chat_template(tools=...) does over the same template."""
    name, lm, _ = served
    if name != "hermes":
        pytest.skip("the fallback convention is kvwire's own: transformers has no counterpart")
    transformers = pytest.importorskip("transformers")
    from kvwire.serve.schemas import ChatRequest
    from kvwire.serve.tool_use import ToolUse

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    use = ToolUse(ChatRequest(messages=messages, tools=TOOLS), lm.tokenizer)
    ours_messages, variables = use.conversation()
    ours = lm.tokenizer.chat_template.render(ours_messages, add_generation_prompt=True, **variables)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=lm.tokenizer.backend, chat_template=HERMES)
    theirs = hf.apply_chat_template([{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == theirs


def test_auto_and_none_leave_text_as_content(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=8)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools.0.function.name", "pattern"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name",
     "not one of the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "forced tool call"),
    (dict(tools=TOOLS, tool_choice="required", stop=["x"]), "stop", "grammar decides"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools[0].function.parameters.type", "object"),
    (dict(messages=USER + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], tools=TOOLS),
     "messages[1].tool_call_id", "call_9"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", **{"messages": USER, "max_tokens": 4, **body})
    error = info.value.body
    assert error["param"] == param and words in error["message"], error
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices  # still serving


def test_a_template_without_tools_is_refused_when_the_fallback_is_off():
    server = Server(create_app(tiny_chat_lm(4096), "tiny", max_batch=1, max_length=4096, tool_fallback=False))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat template has no tool support") as info:
            client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=4)
        assert info.value.body["param"] == "tools"
        assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices
    finally:
        server.close()


def test_an_agent_framework_runs_its_tool_loop(served):
    """pydantic-ai with a tool and a structured output: it declares both as tools with tool_choice
    "required", runs the tool the model calls, sends the results back, and ends when the model calls
    its final-result tool with valid arguments (the tiny model's choices are forced valid, not wise)."""
    pydantic = pytest.importorskip("pydantic")
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Forecast(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=served[2].url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=Forecast, model_settings={"max_tokens": NEW, "temperature": 0.0})
    asked = []

    @agent.tool_plain
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    result = agent.run_sync("Is it sunny in Paris?")
    assert isinstance(result.output, Forecast)
    returns = [p for m in result.all_messages() for p in m.parts if type(p).__name__ == "ToolReturnPart"]
    assert asked and len(returns) >= len(asked)  # the model called the tool; every call was answered


@pytest.mark.real
def test_smollm2_reads_its_arguments_from_the_prompt_and_an_agent_loop_runs():
    """SmolLM2-135M-Instruct (its template has no tool support: kvwire's fallback). A forced call takes
    the city from the question; the tool's result goes back in the next turn; pydantic-ai's loop runs
    over it (a structured output makes every turn a call), up to a request limit: every round trip of
    call, run and result works (the 135M model repeats its call rather than giving the result)."""
    pydantic = pytest.importorskip("pydantic")
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    server = Server(create_app(kw.load("smollm2-135m-instruct", progress=False), "smollm2", max_batch=2,
                               max_length=2048))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        weather = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                     "parameters": {"type": "object", "properties": {
                                                         "city": {"type": "string"}}, "required": ["city"]}}}]
        question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        r = client.chat.completions.create(model="smollm2", messages=question, tools=weather, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        history = question + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                              {"role": "tool", "tool_call_id": call.id, "content": "18 C, light rain"}]
        r = client.chat.completions.create(model="smollm2", messages=history, tools=weather, max_tokens=60,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("stop", "tool_calls")  # text, or calls kvwire parsed

        model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
        class Report(pydantic.BaseModel):
            summary: str = pydantic.Field(max_length=80)

        # a structured output: pydantic-ai offers it as a tool too, and every turn must call one
        agent = Agent(model, output_type=Report, model_settings={"max_tokens": 60, "temperature": 0.0,
                                                                 "parallel_tool_calls": False})
        asked = []

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Current weather in a city."""
            asked.append(city)
            return "18 C, light rain"

        try:  # SmolLM2-135M keeps calling get_weather rather than final_result: the limit ends the loop
            agent.run_sync("What is the weather in Paris right now?", usage_limits=UsageLimits(request_limit=3))
        except UsageLimitExceeded:
            assert len(asked) == 3  # three calls parsed, run, their results sent back
        assert asked[:1] == ["Paris"]
    finally:
        server.close()


def test_a_call_that_does_not_parse_stays_content_with_a_warning(client, served, caplog):
    """The model's markup naming a function the request did not declare (forced here with a regex)
    comes back as text, finish_reason "stop", and a warning in the log: never a 500."""
    name, lm, _ = served
    text = '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>'
    with caplog.at_level("WARNING", logger="kvwire.serve.tools"):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=NEW, extra_body={
            "response_format": {"type": "regex", "regex": re.escape(text)}})
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == text
    assert any("launch_rocket" in rec.getMessage() for rec in caplog.records)
