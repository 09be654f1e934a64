"""The tool-call formats kvwire reads and writes, and the choice of one from a chat template's text.

A native format is one the checkpoint's template renders itself (tools as the `tools` variable, past
calls as `tool_calls` of assistant messages) and the model was trained to write; "fallback" is
kvwire's own convention for templates with no tool support (see `prepare_messages`).
"""
import re
from dataclasses import dataclass, field
from typing import Callable

from .grammar import llama3_grammar, mistral_args_grammar, mistral_list_grammar, tagged_grammar
from .scan import PYTHON_TAG, TOOL_CALLS, scan_llama3, scan_mistral, scan_tagged


@dataclass(frozen=True)
class ToolFormat:
    """How tools reach the prompt and how the model writes calls.

    Attributes:
        name: "hermes", "llama3", "mistral", "mistral-args" or "fallback".
        native: the chat template renders tools and past calls itself (False: `prepare_messages`
            rewrites them into plain text turns).
        markers: strings a reply's calls hold. Where one is a special token, decode the reply with it
            kept (not skipped) so `parse` sees it, and pass `marker_token_ids` to `constraint_grammar`.
        call_id_length: the length the template wants tool-call ids to have (Mistral: 9 letters and
            digits); `prepare_messages` maps other ids to such ones.
        scan: reads calls out of text (see `scan`); grammar: writes the constraint grammar.

    Example:
        >>> FORMATS["hermes"].markers
        ('<tool_call>', '</tool_call>')
    """

    name: str
    native: bool
    markers: tuple
    scan: Callable = field(repr=False)
    grammar: Callable = field(repr=False)
    call_id_length: int | None = None


HERMES = ToolFormat("hermes", True, ("<tool_call>", "</tool_call>"), scan_tagged("<tool_call>", "</tool_call>"),
                    tagged_grammar("<tool_call>", "</tool_call>", newlines=True))
LLAMA3 = ToolFormat("llama3", True, (PYTHON_TAG,), scan_llama3, llama3_grammar)
MISTRAL = ToolFormat("mistral", True, (TOOL_CALLS,), scan_mistral, mistral_list_grammar, call_id_length=9)
MISTRAL_ARGS = ToolFormat("mistral-args", True, (TOOL_CALLS, "[ARGS]", "[CALL_ID]"), scan_mistral,
                          mistral_args_grammar, call_id_length=9)
FALLBACK = ToolFormat("fallback", False, ("<tool_call>", "</tool_call>"), scan_tagged("<tool_call>", "</tool_call>"),
                      tagged_grammar("<tool_call>", "</tool_call>", newlines=False))
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, FALLBACK)}

# (format, strings the template holds, strings it does not): the first rule that matches a template
# mentioning `tools` wins. Qwen3-Coder's <tool_call><function=...> XML is not Hermes' JSON, and
# "parameters" alone is too common a word, so Llama 3 also needs its header token.
_RULES = (
    (MISTRAL_ARGS, (TOOL_CALLS, "[ARGS]"), ()),
    (MISTRAL, (TOOL_CALLS,), ()),
    (HERMES, ("<tool_call>",), ("<function=",)),
    (LLAMA3, ("<|start_header_id|>", PYTHON_TAG), ()),
    (LLAMA3, ("<|start_header_id|>", '"parameters"'), ()),
)
_MENTIONS_TOOLS = re.compile(r"\btools\b")


def detect_format(template_source):
    """The tool format a chat template speaks, read from its text; "fallback" for a template that
    never mentions `tools` or whose call markup kvwire does not know.

    Args:
        template_source: the jinja text (`ChatTemplate.source`), or None (no template).

    Example:
        >>> detect_format("{% for m in messages %}{{ m.content }}{% endfor %}").name
        'fallback'
    """
    if not template_source or not _MENTIONS_TOOLS.search(template_source):
        return FALLBACK
    for fmt, present, absent in _RULES:
        if all(s in template_source for s in present) and not any(s in template_source for s in absent):
            return fmt
    return FALLBACK


def tool_format(name):
    """The format called `name` (one of `FORMATS`), for a server option that overrides detection."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]
