"""Reading tool calls out of a reply, one syntax per function, for whole replies and for streams.

A scanner takes the reply text not yet settled and returns (segments, settled): the segments cover
text[:settled] and never change when more text arrives, so a stream can send them at once. A segment
is ("text", str), ("call", name, arguments as a JSON string) or ("bad", str, why): text that opened
a call but did not parse, which stays content. Scanners settle only where the decision is certain and
hold the rest (a possible opener being assembled, a call not yet closed); with final=True they settle
everything. `at_start` says the text begins the reply (Llama 3's call is the whole reply).
"""
import json
import re

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEAD = re.compile(r"([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")  # Mistral's name[ARGS] form
_PARTIAL_HEAD = re.compile(r"[A-Za-z0-9_-]{0,64}(?:\[CALL_ID\][A-Za-z0-9]*)?")
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"


class _Bad(ValueError):
    """Why a would-be call is not one."""


def scan_tagged(opener, closer):
    """A scanner for calls as `opener` JSON `closer` blocks (Hermes' <tool_call>...</tool_call>),
    each holding {"name", "arguments"} (or a list of them); text around them is content. A block
    missing its closer at the end of the reply is read to the end."""

    def scan(text, final, at_start, names):
        segments, pos = [], 0
        while True:
            i = text.find(opener, pos)
            if i < 0:
                return _tail(text, pos, final, opener, segments)
            _add_text(segments, text[pos:i])
            j = text.find(closer, i + len(opener))
            if j < 0 and not final:
                return segments, i
            end = len(text) if j < 0 else j + len(closer)
            segments.extend(_block(text[i:end], text[i + len(opener):j if j >= 0 else end], names))
            pos = end

    return scan


def scan_mistral(text, final, at_start, names):
    """Mistral: [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3 to v7 tokenizers), or
    [TOOL_CALLS]name[ARGS]{...} once per call (v11 and later); text before and after is content."""
    segments, pos = [], 0
    while True:
        i = text.find(TOOL_CALLS, pos)
        if i < 0:
            return _tail(text, pos, final, TOOL_CALLS, segments)
        _add_text(segments, text[pos:i])
        read = _mistral_calls(text, i + len(TOOL_CALLS), final, names)
        if read is None:
            return segments, i
        segments.extend(read[0])
        pos = read[1]


def scan_llama3(text, final, at_start, names):
    """Llama 3.1+: the whole reply is a JSON call {"name", "parameters"} (several joined by ';'),
    optionally after <|python_tag|>; any other reply is content."""
    stripped = text.lstrip()
    if not at_start:
        return [("text", text)] if text else [], len(text)
    if not final:
        maybe_call = not stripped or stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped)
        return ([], 0) if maybe_call else ([("text", text)], len(text))
    tagged = stripped.startswith(PYTHON_TAG)
    body = stripped[len(PYTHON_TAG):] if tagged else stripped
    if not tagged and not body.startswith("{"):
        return [("text", text)] if text else [], len(text)
    try:
        return [_call(value, names) for value in _json_sequence(body)], len(text)
    except ValueError as e:
        return [("bad", text, f"the reply is not a JSON call {{\"name\", \"parameters\"}}: {e}")], len(text)


def _mistral_calls(text, k, final, names):
    """(segments, end) of what follows a [TOOL_CALLS] ending at k: the calls, or the marker alone as
    a "bad" segment (the text after it is then read again); None while more text could complete it."""
    start = _WS.match(text, k).end()
    value_at, head = start, None  # the JSON list (v3-v7), or the arguments after name[ARGS] (v11+)
    if text[start:start + 1] not in ("[", "{"):
        head = _HEAD.match(text, start)
        if head is None:
            rest = _without_partial(text[start:], "[ARGS]")
            if not final and _PARTIAL_HEAD.fullmatch(_without_partial(rest, "[CALL_ID]")):
                return None
            return [("bad", TOOL_CALLS, f"no JSON list of calls or name[ARGS]{{...}} after {TOOL_CALLS}: "
                                        f"{text[start:start + 40]!r}")], k
        value_at = _WS.match(text, head.end()).end()
    try:
        value, end = _DECODER.raw_decode(text, value_at)
    except ValueError as e:
        if not final:
            return None
        return [("bad", TOOL_CALLS, f"the JSON after {TOOL_CALLS} does not parse: {e}")], k
    try:
        if head is None:
            return _calls(value, names), end
        return [_call({"name": head.group(1), "arguments": value}, names)], end
    except ValueError as e:
        return [("bad", TOOL_CALLS, str(e))], k


def _block(raw, body, names):
    """The call segments of one tagged block's body, or the block as a "bad" segment."""
    try:
        return _calls(json.loads(body), names)
    except ValueError as e:
        return [("bad", raw, str(e))]


def _calls(value, names):
    values = value if isinstance(value, list) else [value]
    if not values:
        raise _Bad("an empty list of calls")
    return [_call(v, names) for v in values]


def _call(value, names):
    """A ("call", name, arguments JSON) segment from a decoded call object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise _Bad(f"expected a JSON object with a string 'name', got {json.dumps(value)[:80]}")
    name = value["name"]
    key = "arguments" if "arguments" in value else "parameters"
    if key not in value:
        raise _Bad(f"the call of {name!r} has no 'arguments'")
    arguments = value[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _Bad(f"the arguments of {name!r} are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise _Bad(f"the arguments of {name!r} are not a JSON object: {json.dumps(arguments)[:80]}")
    if not _NAME.fullmatch(name) or (names is not None and name not in names):
        raise _Bad(f"{name!r} is not one of the tools {sorted(names or ())}")
    return ("call", name, json.dumps(arguments, ensure_ascii=False))


def _json_sequence(body):
    """The JSON values of `a; b; c` (whitespace around each; a last ';' allowed)."""
    values, pos = [], _WS.match(body).end()
    while pos < len(body):
        value, pos = _DECODER.raw_decode(body, pos)
        values.append(value)
        pos = _WS.match(body, pos).end()
        if pos < len(body) and body[pos] != ";":
            raise _Bad(f"text after the call at character {pos}: {body[pos:pos + 40]!r}")
        pos = _WS.match(body, pos + 1).end()
    return values


def _tail(text, pos, final, opener, segments):
    """Settle text[pos:] (no opener in it) but a trailing partial opener, which may still grow."""
    end = len(text) if final else len(text) - _partial(text[pos:], opener)
    _add_text(segments, text[pos:end])
    return segments, end


def _partial(text, marker):
    """Length of the longest end of `text` that starts `marker` (a marker being assembled)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _without_partial(text, marker):
    return text[:len(text) - _partial(text, marker)]


def _add_text(segments, text):
    if text:
        segments.append(("text", text))
