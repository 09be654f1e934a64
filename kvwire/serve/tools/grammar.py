"""Grammars that force a reply into tool calls (tool_choice "required" or a named function), in
llguidance's Lark dialect: each call's JSON through `%json {schema}`, the format's markup around it."""
import json

from ...generate.constrain import JSON_WHITESPACE
from .check import check_tools, chosen_tools
from .scan import TOOL_CALLS

# every %json schema: keywords llguidance cannot enforce are ignored rather than refused (a tool's
# schema is the client's), and whitespace is bounded as in every kvwire JSON constraint, so a model
# cannot pad a call forever
_GUIDANCE = {"lenient": True, **JSON_WHITESPACE}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def constraint_grammar(tools, tool_choice, fmt, parallel=True, token_ids=None):
    """The Lark grammar (llguidance) a reply must match under `tool_choice`, or None when it is free.

    Args:
        tools: the request's checked tools (see `check_tools`).
        tool_choice: "required" (one or more calls of any tool; exactly one if not `parallel`) or
            {"type": "function", "function": {"name": n}} (one call of n); None, "auto" and "none"
            give None.
        fmt: the `ToolFormat` whose markup the calls take.
        parallel: whether "required" allows several calls (OpenAI's `parallel_tool_calls`).
        token_ids: {marker: token id} for the format's markers that are single tokens of the
            vocabulary (`marker_token_ids`); the grammar then asks for the token (`<[id]>`), since
            llguidance never matches an added token against literal text. Markers not named are text.

    Returns:
        A grammar text starting `%llguidance {}`, for `Constraint.grammar` / `LLMatcher.grammar_from_lark`.

    Raises:
        ToolError: as `check_tools` for tools or a tool_choice that cannot be used.

    Example:
        >>> tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        ...     "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        >>> from kvwire.serve.tools import FORMATS
        >>> print(constraint_grammar(tools, "required", FORMATS["fallback"]).splitlines()[1])
        start: block ("\\n" block)*
    """
    check_tools(tools, tool_choice)
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    chosen = [(t["function"]["name"], _arguments_schema(t["function"].get("parameters")))
              for t in chosen_tools(tools, tool_choice)]
    many = tool_choice == "required" and parallel
    token_ids = dict(token_ids or {})

    def mark(text):
        return f"<[{token_ids[text]}]>" if text in token_ids else json.dumps(text)

    return "%llguidance {}\n" + fmt.grammar(chosen, many, mark)


def marker_token_ids(fmt, backend):
    """{marker: id} of `fmt.markers` that are single tokens of `backend` (a `tokenizers.Tokenizer`),
    for `constraint_grammar(token_ids=...)`."""
    ids = {m: backend.token_to_id(m) for m in fmt.markers}
    return {m: i for m, i in ids.items() if i is not None}


def tagged_grammar(opener, closer, newlines):
    """Hermes / the fallback: `opener call closer` blocks, joined by newlines; `newlines` puts one
    inside each block around the JSON, as Hermes templates write it."""
    inner = ' "\\n" ' if newlines else " "

    def grammar(chosen, many, mark):
        start = 'start: block ("\\n" block)*' if many else "start: block"
        block = f"block: {mark(opener)}{inner}call{inner}{mark(closer)}"
        return "\n".join([start, block, *_alternatives("call", chosen, "arguments")]) + "\n"

    return grammar


def mistral_list_grammar(chosen, many, mark):
    """Mistral v3-v7: [TOOL_CALLS] then one JSON list of {"name", "arguments"}."""
    schema = {"type": "array", "items": {"anyOf": [_call_schema(n, s, "arguments") for n, s in chosen]},
              "minItems": 1, **({} if many else {"maxItems": 1}), "x-guidance": _GUIDANCE}
    return f'start: {mark(TOOL_CALLS)} " "? calls\ncalls: %json {json.dumps(schema)}\n'


def mistral_args_grammar(chosen, many, mark):
    """Mistral v11+: [TOOL_CALLS]name[ARGS]{arguments} per call."""
    lines = ["start: call+" if many else "start: call", f"call: {mark(TOOL_CALLS)} function",
             "function: " + " | ".join(f'{json.dumps(n)} {mark("[ARGS]")} args_{i}' for i, (n, _) in enumerate(chosen))]
    lines += [f"args_{i}: %json {json.dumps({**s, 'x-guidance': _GUIDANCE})}" for i, (_, s) in enumerate(chosen)]
    return "\n".join(lines) + "\n"


def llama3_grammar(chosen, many, mark):
    """Llama 3.1+: the reply is one JSON {"name", "parameters"} (Llama's templates take one call a turn)."""
    return "\n".join(["start: call", *_alternatives("call", chosen, "parameters")]) + "\n"


def _alternatives(rule, chosen, key):
    lines = [f"{rule}: " + " | ".join(f"{rule}_{i}" for i in range(len(chosen)))]
    return lines + [f"{rule}_{i}: %json {json.dumps({**_call_schema(n, s, key), 'x-guidance': _GUIDANCE})}"
                    for i, (n, s) in enumerate(chosen)]


def _call_schema(name, arguments, key):
    return {"type": "object", "properties": {"name": {"const": name}, key: arguments},
            "required": ["name", key], "additionalProperties": False}


def _arguments_schema(parameters):
    # OpenAI: no parameters is a function of no arguments
    return _NO_ARGUMENTS if parameters is None else {"type": "object", **parameters}

