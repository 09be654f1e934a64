"""A reply's text as OpenAI's message: content and tool_calls, whole (`parse`) or as stream deltas
(`ToolCallStream`). Both read the reply with the format's scanner, so the deltas of a stream add up
to what `parse` returns for the whole text, however the text was split."""
import logging
import uuid

from .check import tool_names

log = logging.getLogger("kvwire.serve.tools")


def parse(text, fmt, tools=None):
    """(content, calls) of a reply: the text outside tool calls, and the calls in OpenAI's shape.

    Args:
        text: the reply as generated (markers kept: see `ToolFormat.markers`).
        fmt: the `ToolFormat` the model writes.
        tools: the request's tools; a call naming another function stays content. None: any name.

    Returns:
        content: the text outside calls, stripped; None when it is empty and there are calls.
        calls: `[{"id": "call_<24 hex>", "type": "function", "function": {"name": str, "arguments": str}}]`,
            arguments a JSON object as a string. Markup that opens a call but does not parse stays
            content, with a warning logged; model output never raises.

    Example:
        >>> parse('Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', FORMATS["hermes"])
        ('Sure.', [{'id': 'call_...', 'type': 'function', 'function': {'name': 'f', 'arguments': '{"x": 1}'}}])
    """
    segments, _ = fmt.scan(text, True, True, _names(tools))
    texts, calls = [], []
    for segment in segments:
        if segment[0] == "call":
            calls.append(_call(segment))
        else:
            texts.append(segment[1])
            _warn(fmt, segment)
    content = "".join(texts).strip()
    return (content or None) if calls else content, calls


class ToolCallStream:
    """Turns a reply arriving in pieces into OpenAI chat-chunk deltas.

    `feed(piece)` and, at the end, `flush()` return lists of deltas: {"content": str} for text as it
    arrives (held back only while a call's markup may be starting, and at the edges, where `parse`
    strips whitespace), and per call {"tool_calls": [{"index": i, "id", "type": "function",
    "function": {"name", "arguments": ""}}]} then {"tool_calls": [{"index": i, "function":
    {"arguments": str}}]}. A call is sent once it is complete and parsed (its arguments in one
    piece), so a stream never shows a call that `parse` would refuse.

    Example:
        >>> s = ToolCallStream(FORMATS["hermes"])
        >>> s.feed("Hi <tool")
        [{'content': 'Hi'}]
        >>> s.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
        [{'tool_calls': [{'index': 0, 'id': 'call_...', 'type': 'function',
                          'function': {'name': 'f', 'arguments': ''}}]},
         {'tool_calls': [{'index': 0, 'function': {'arguments': '{}'}}]}]
    """

    def __init__(self, fmt, tools=None):
        self.fmt, self.names = fmt, _names(tools)
        self.rest, self.at_start, self.done = "", True, False
        self.calls = 0
        self.spoke, self.space = False, ""  # content sent yet; whitespace held until more text

    def feed(self, piece):
        """Deltas for the new text `piece`."""
        if self.done:
            raise RuntimeError("feed() after flush(): this stream has ended")
        self.rest += piece
        return self._settle(final=False)

    def flush(self):
        """Deltas for whatever was held, at the end of the reply."""
        deltas = [] if self.done else self._settle(final=True)
        self.done = True
        return deltas

    def _settle(self, final):
        segments, used = self.fmt.scan(self.rest, final, self.at_start, self.names)
        self.rest, self.at_start = self.rest[used:], self.at_start and used == 0
        deltas = []
        for segment in segments:
            if segment[0] == "call":
                deltas.extend(self._call_deltas(segment))
            else:
                _warn(self.fmt, segment)
                deltas.extend(self._text_delta(segment[1]))
        return deltas

    def _call_deltas(self, segment):
        call, index = _call(segment), self.calls
        self.calls += 1
        arguments = call["function"]["arguments"]
        return [{"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                 "function": {"name": call["function"]["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]

    def _text_delta(self, text):
        # as parse's strip(): no leading whitespace; trailing whitespace only once more text follows
        if not self.spoke:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.space += text
            return []
        delta, self.space, self.spoke = self.space + body, text[len(body):], True
        return [{"content": delta}]


def _call(segment):
    _, name, arguments = segment
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _names(tools):
    return None if tools is None else set(tool_names(tools))


def _warn(fmt, segment):
    if segment[0] == "bad":
        log.warning("a %s tool call did not parse and stays content (%s): %.200r", fmt.name, segment[2], segment[1])
