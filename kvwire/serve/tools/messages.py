"""OpenAI-shaped chat messages with tool calls and tool results, turned into what a chat template
takes: transformers' convention for templates that render tools, plain text turns for the others."""
import hashlib
import json

from .check import ToolError, check_tools

FALLBACK_INSTRUCTIONS = """You can call functions (tools). Their JSON schemas:
{tools}
To call a function, answer with a <tool_call></tool_call> block holding a JSON object with its name \
and arguments, one block per call and nothing else, like:
<tool_call>{{"name": "{example}", "arguments": {{"argument_name": "value"}}}}</tool_call>
Function results come back in user messages that start with "Tool result". If no function is \
needed, answer normally."""


def prepare_messages(messages, tools, fmt):
    """(messages, template variables) for `ChatTemplate.render(messages, **variables)`.

    Args:
        messages: OpenAI chat messages: assistant messages may carry `tool_calls` ([{"id", "type":
            "function", "function": {"name", "arguments": JSON string}}]), and {"role": "tool",
            "tool_call_id", "content"} messages answer them.
        tools: the request's checked tools, or None.
        fmt: the `ToolFormat` of the template.

    Returns:
        For a native format, the messages with each call's arguments decoded to a dict (ids
        shortened where the template wants, e.g. Mistral's 9 characters; tool messages given the
        function's `name`) and {"tools": tools} (empty without tools), as transformers passes them.
        For "fallback", plain system/user/assistant text turns and {}: the tools' schemas and how to
        call them lead the system message (one is inserted if there is none), past calls are the
        assistant's text as `<tool_call>{...}</tool_call>`, and each run of tool results is one user
        message `"Tool result (name, id):\\n..."`.

    Raises:
        ToolError: naming the malformed field ("messages[2].tool_calls[0].function.arguments", or
            a field of `tools` as `check_tools`).

    Example:
        >>> msgs, variables = prepare_messages([{"role": "user", "content": "Weather in Paris?"}], tools, fmt)
        >>> template.render(msgs, add_generation_prompt=True, **variables)
    """
    check_tools(tools)
    if not isinstance(messages, (list, tuple)):
        return messages, {}  # not a conversation: ChatTemplate.render says what it expected
    names = {}  # tool-call id -> function name, from the assistant messages seen so far
    checked = [_checked(m, i, names) for i, m in enumerate(messages)]
    if fmt.native:
        return [_native(m, read, fmt) for m, read in checked], ({"tools": [dict(t) for t in tools]} if tools else {})
    return _fallback(checked, tools), {}


def _checked(message, i, names):
    """(message, what was read from it): an assistant message's calls as [(id, name, arguments
    dict)], a tool message (its content made text) and its function's name, else None."""
    if not isinstance(message, dict):
        return message, None  # the template's own checks name it
    role = message.get("role")
    if role == "function":
        raise ToolError(f"messages[{i}].role", "'function' (OpenAI's deprecated function calling) is not "
                                               "supported; send tool results as role 'tool' with a tool_call_id")
    if role == "assistant" and message.get("tool_calls") == []:
        return {k: v for k, v in message.items() if k != "tool_calls"}, None  # no calls: a plain turn
    if role == "assistant" and message.get("tool_calls"):
        raw = message["tool_calls"]
        if not isinstance(raw, list):
            raise ToolError(f"messages[{i}].tool_calls", f"expected a list of calls, got {type(raw).__name__}")
        calls = [_checked_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(raw)]
        names.update({call_id: name for call_id, name, _ in calls})
        return message, calls
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ToolError(f"messages[{i}].tool_call_id", f"a tool message needs the id of the call it answers; "
                                                           f"got {call_id!r:.40}")
        if call_id not in names:
            raise ToolError(f"messages[{i}].tool_call_id", f"{call_id!r} is not the id of a tool call of an "
                                                           f"earlier assistant message")
        return {**message, "content": _text(message.get("content"), f"messages[{i}].content")}, names[call_id]
    return message, None


def _checked_call(call, where):
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ToolError(where, f"expected {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}, "
                               f"got {call!r:.80}")
    if call.get("type", "function") != "function":
        raise ToolError(f"{where}.type", f"{call['type']!r} is not supported; expected 'function'")
    if not isinstance(call.get("id"), str):
        raise ToolError(f"{where}.id", f"expected the call's id as a string, got {call.get('id')!r:.40}")
    name, arguments = call["function"].get("name"), call["function"].get("arguments")
    if not isinstance(name, str):
        raise ToolError(f"{where}.function.name", f"expected a string, got {name!r:.40}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolError(f"{where}.function.arguments", f"is not JSON ({e}); expected the arguments "
                                                           f"object as a JSON string") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"{where}.function.arguments", f"expected a JSON object (as a string), got "
                                                       f"{json.dumps(arguments)[:60]}")
    return call["id"], name, arguments


def _native(message, read, fmt):
    if isinstance(read, list):
        return {**message, "tool_calls": [{"id": _call_id(i, fmt), "type": "function",
                                           "function": {"name": n, "arguments": a}} for i, n, a in read]}
    if isinstance(read, str):
        return {**message, "tool_call_id": _call_id(message["tool_call_id"], fmt), "name": read}
    return message


def _call_id(call_id, fmt):
    """The id as the template wants it: Mistral's templates refuse ids that are not 9 letters or
    digits, so others are mapped (the same way for the call and its result)."""
    n = fmt.call_id_length
    if n is None or (len(call_id) == n and call_id.isascii() and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:n]


def _fallback(messages, tools):
    out, results = [], False  # results: out[-1] is a user turn of tool results
    for i, (m, read) in enumerate(messages):
        if isinstance(read, list):
            said = _text(m.get("content"), f"messages[{i}].content")
            markup = "\n".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}</tool_call>"
                               for _, n, a in read)
            rest = {k: v for k, v in m.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": f"{said}\n{markup}" if said else markup})
        elif isinstance(read, str):
            result = f"Tool result ({read}, {m['tool_call_id']}):\n{m['content']}"
            if results:  # one user turn per run of results: many templates insist roles alternate
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{result}"}
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append(m)
        results = isinstance(read, str)
    return _with_instructions(out, tools) if tools else out


def _with_instructions(messages, tools):
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = FALLBACK_INSTRUCTIONS.format(tools=schemas, example=tools[0]["function"]["name"])
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "system":
        system = _text(first.get("content"), "messages[0].content")
        return [{**first, "content": f"{text}\n\n{system}" if system else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _text(content, where):
    """A message's content as one string: a str, text parts joined by newlines, or None as ""."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise ToolError(where, f"expected text (a string or text parts), got {json.dumps(content)[:80]}")
