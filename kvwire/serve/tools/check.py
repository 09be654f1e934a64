"""Checks of a request's `tools` and `tool_choice` (OpenAI's chat-completions shapes), each error
naming the field, so the server answers a 400 that points at the mistake."""
import re

from ...generate.request import RequestError

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("auto", "none", "required")


class ToolError(RequestError):
    """A tool definition, a `tool_choice` or a tool message that cannot be used; `param` names the
    field ("tools[1].function.name", "messages[3].tool_call_id")."""

    def __init__(self, param, problem):
        super().__init__(f"{param}: {problem}", param)


def check_tools(tools, tool_choice=None):
    """Refuse, naming the field, tool definitions or a tool_choice that OpenAI's API refuses.

    Args:
        tools: None or a non-empty list of {"type": "function", "function": {"name", "description"?,
            "parameters"?, "strict"?}}; names match ^[a-zA-Z0-9_-]{1,64}$ and differ; parameters is a
            JSON schema of an object.
        tool_choice: None, "auto", "none", "required" or {"type": "function", "function": {"name": n}}
            with n one of the tools ("required" and a named function need tools).

    Raises:
        ToolError: (a ValueError) its message starts with the field's path, also its `param`.

    Example:
        >>> try:
        ...     check_tools([{"type": "function", "function": {"name": "get weather"}}], "auto")
        ... except ToolError as e:
        ...     print(e.param)
        tools[0].function.name
    """
    names = _checked_tools(tools)
    _check_choice(tool_choice, names)


def tool_names(tools):
    """The function names of checked `tools`, in order (empty for None)."""
    return [t["function"]["name"] for t in tools or ()]


def chosen_tools(tools, tool_choice):
    """The tools a call may name under `tool_choice`: all of them, or the named one."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [t for t in tools if t["function"]["name"] == name]
    return list(tools or ())


def _checked_tools(tools):
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ToolError("tools", f"expected a list of {{'type': 'function', 'function': {{...}}}}, got "
                                 f"{type(tools).__name__}")
    if not tools:
        raise ToolError("tools", "an empty list; send at least one tool, or no 'tools' field")
    seen = {}
    for i, tool in enumerate(tools):
        name = _checked_tool(tool, f"tools[{i}]")
        if name in seen:
            raise ToolError(f"tools[{i}].function.name", f"{name!r} is also the name of tools[{seen[name]}]; "
                                                         f"function names must differ")
        seen[name] = i
    return list(seen)


def _checked_tool(tool, where):
    if not isinstance(tool, dict):
        raise ToolError(where, f"expected an object {{'type': 'function', 'function': {{...}}}}, got "
                               f"{type(tool).__name__}")
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type", f"{tool.get('type')!r} is not supported; expected 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function", f"expected an object with 'name' (and 'description', "
                                             f"'parameters'), got {_kind(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name", f"{name!r} is not a function name; expected 1-64 letters, "
                                                  f"digits, '_' or '-'")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ToolError(f"{where}.function.description", f"expected a string, got {_kind(function['description'])}")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ToolError(f"{where}.function.strict", f"expected true or false, got {_kind(function['strict'])}")
    _check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return name


def _check_parameters(schema, where):
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise ToolError(where, f"expected a JSON schema object like {{'type': 'object', 'properties': {{...}}}}, "
                               f"got {_kind(schema)}")
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where}.type", f"{schema['type']!r}; the arguments of a function are an object, so "
                                         f"expected 'object'")
    if schema.get("properties") is not None and not isinstance(schema["properties"], dict):
        raise ToolError(f"{where}.properties", f"expected an object mapping argument names to schemas, got "
                                               f"{_kind(schema['properties'])}")


def _check_choice(choice, names):
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required":
        if not names:
            raise ToolError("tool_choice", "'required' needs tools; the request has none")
        return
    if isinstance(choice, str):
        raise ToolError("tool_choice", f"{choice!r} is not a choice; expected one of {list(CHOICES)} or "
                                       f"{{'type': 'function', 'function': {{'name': ...}}}}")
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise ToolError("tool_choice", f"expected one of {list(CHOICES)} or {{'type': 'function', 'function': "
                                       f"{{'name': ...}}}}, got {choice!r:.80}")
    name = choice["function"].get("name")
    if name not in names:
        known = f"the tools are {names}" if names else "the request has no tools"
        raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools; {known}")


def _kind(value):
    return "nothing" if value is None else type(value).__name__
