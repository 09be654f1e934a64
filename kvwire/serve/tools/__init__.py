"""Tool calling for chat completions (OpenAI's `tools` and `tool_choice`), as pure functions the
server calls: check the request (`check_tools`), pick the template's format (`detect_format`),
render the conversation (`prepare_messages`), force calls when asked (`constraint_grammar`) and
read them back (`parse`, or `ToolCallStream` for streams). See docs/tools.md.

Example:
    >>> check_tools(request.tools, request.tool_choice)
    >>> fmt = detect_format(lm.tokenizer.chat_template.source)
    >>> messages, variables = prepare_messages(request.messages, request.tools, fmt)
    >>> prompt = lm.tokenizer.chat_template.render(messages, add_generation_prompt=True, **variables)
    >>> grammar = constraint_grammar(request.tools, request.tool_choice, fmt,
    ...                              token_ids=marker_token_ids(fmt, lm.tokenizer.backend))
    >>> content, calls = parse(reply_text, fmt, request.tools)
"""
from .check import ToolError, check_tools
from .formats import FORMATS, ToolFormat, detect_format, tool_format
from .grammar import constraint_grammar, marker_token_ids
from .messages import prepare_messages
from .replies import ToolCallStream, parse

__all__ = ["FORMATS", "ToolCallStream", "ToolError", "ToolFormat", "check_tools", "constraint_grammar",
           "detect_format", "marker_token_ids", "parse", "prepare_messages", "tool_format"]
