"""One chat request's tools, between the request and the reply: which format the model's template
speaks, the conversation as the template takes it, the constraint a forced call needs, and the
reply read back into OpenAI's `tool_calls` (whole, or as stream deltas). The formats themselves are
in `kvwire.serve.tools`."""
import functools
import weakref

from ..generate.constrain import Constraint
from .errors import APIError
from .tools import ToolCallStream, check_tools, constraint_grammar, detect_format, marker_token_ids, parse
from .tools import prepare_messages

_formats = weakref.WeakKeyDictionary()  # tokenizer -> its template's ToolFormat


def template_format(tokenizer):
    """The tool format of `tokenizer`'s chat template (read from its text once)."""
    if tokenizer not in _formats:
        template = tokenizer.chat_template
        _formats[tokenizer] = detect_format(None if template is None else template.source)
    return _formats[tokenizer]


def uses_tools(body):
    """Whether a chat request involves tools: it declares some, or its history holds calls or results."""
    return bool(body.tools) or body.tool_choice not in (None, "auto", "none") or any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") in ("tool", "function")) for m in body.messages)


class ToolUse:
    """The tools of one chat request (`body`: a ChatRequest), checked.

    Args:
        tokenizer: the served model's (its chat template picks the format).
        fallback: whether a template with no tool support gets kvwire's convention (tools in a system
            message, calls as <tool_call> JSON); False refuses such requests with a 400 naming it.

    Example:
        >>> use = ToolUse(body, lm.tokenizer)
        >>> messages, variables = use.conversation()
        >>> message, finish_reason = use.message(reply_text, "stop")
    """

    def __init__(self, body, tokenizer, fallback=True):
        self.tools = [_plain(t) for t in body.tools] if body.tools else None
        self.choice = _plain(body.tool_choice)
        check_tools(self.tools, self.choice)  # a ToolError (RequestError): a 400 naming the field
        self.body, self.tokenizer, self.fmt = body, tokenizer, template_format(tokenizer)
        self.active = bool(self.tools) and self.choice != "none"  # calls are read from the reply
        if self.active and not self.fmt.native and not fallback:
            raise APIError("tools: this model's chat template has no tool support (it never renders `tools`), and "
                           "this server does not use kvwire's fallback convention (started with "
                           "--no-tool-fallback)", param="tools", code="unsupported")

    @property
    def keep_special(self):
        """Decode the reply with special tokens kept: native markers ([TOOL_CALLS], <|python_tag|>) are."""
        return self.active and self.fmt.native

    def conversation(self):
        """(messages, template variables) for the chat template."""
        return prepare_messages(self.body.messages, self.tools if self.active else None, self.fmt)

    @functools.cached_property
    def constraint(self):
        """The `Constraint` forcing calls for tool_choice "required" or a named function, else None."""
        if not self.active:
            return None
        grammar = constraint_grammar(self.tools, self.choice, self.fmt,
                                     parallel=self.body.parallel_tool_calls is not False,
                                     token_ids=marker_token_ids(self.fmt, self.tokenizer.backend))
        return None if grammar is None else Constraint.grammar(grammar, param="tool_choice")

    def message(self, text, finish_reason):
        """The assistant message of a whole reply and its finish reason ("tool_calls" when it called)."""
        if not self.active:
            return {"role": "assistant", "content": text, "refusal": None}, finish_reason
        content, calls = parse(text, self.fmt, self.tools)
        message = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return message, "tool_calls" if calls and finish_reason == "stop" else finish_reason

    def stream(self):
        """A `ToolCallStream` for one streamed choice, or None when calls are not read."""
        return ToolCallStream(self.fmt, self.tools) if self.active else None


def _plain(value):
    """A request model (a Tool, a NamedToolChoice) as the JSON dict the client sent."""
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value
