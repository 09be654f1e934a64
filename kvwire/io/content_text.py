"""Message content tokenised as text: special-token strings a caller writes inside a message (a
user typing `<|im_end|><|im_start|>system`) stay text, while the chat template's own markup still
becomes control tokens.

How: before rendering, each special-token string found in a message's content is swapped for a
private-use character no input holds; the template renders; the rendered text is split at the
special tokens the tokenizer finds in it (only the template's own, since the caller's are hidden);
each piece between them, its hidden strings put back, is encoded with special tokens read as text
(`encode_special_tokens`, transformers' `split_special_tokens=True`). That is exactly how the
tokenizer itself splits text at added tokens first and encodes the pieces apart, so a conversation
with no special-token strings in its content gives the same ids as tokenising the rendered text.
"""
import json
import re
import threading

from tokenizers import Tokenizer as Backend

_PRIVATE = range(0xF0000, 0xFFFFE)  # Unicode's supplementary private use area A: no tokenizer's markup


class ContentText:
    """A tokenizer backend's special tokens, and a copy of it that reads them as text.

    Example:
        >>> text = ContentText(tok.backend)
        >>> messages, hidden = text.hide([{"role": "user", "content": "<|im_end|>"}], template.source)
        >>> text.encode(template.render(messages), hidden)   # <|im_end|> as '<', '|', 'im', ...
    """

    def __init__(self, backend):
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}
        strings = sorted({added[i].content for i in self.special_ids if added[i].content}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
        self._as_text, self._lock = None, threading.Lock()

    def hide(self, messages, *sources):
        """(messages with each special-token string in a content swapped for a private character,
        {character: string}); the messages as given when no content holds one. `sources`: other text
        the rendered prompt may hold (the template, its variables), which the characters must avoid."""
        if self._pattern is None or not isinstance(messages, (list, tuple)):
            return messages, {}
        found = {m for text in _content_texts(messages) for m in self._pattern.findall(text)}
        if not found:
            return messages, {}
        taken = set(json.dumps([messages, *sources], ensure_ascii=False, default=str))
        chars = (chr(c) for c in _PRIVATE if chr(c) not in taken)
        hidden = {s: next(chars) for s in sorted(found)}

        def swap(text):
            return self._pattern.sub(lambda m: hidden[m.group(0)], text)

        return [_map_content(m, swap) for m in messages], {c: s for s, c in hidden.items()}

    def encode(self, text, hidden):
        """Token ids of a rendered prompt: special tokens where the template wrote them, the hidden
        strings (`hide`'s {character: string}) encoded as text."""
        if not hidden:
            return self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        found = self.backend.encode_batch([text], add_special_tokens=False)[0]
        marks = [(start, end, i) for i, (start, end) in zip(found.ids, found.offsets)
                 if i in self.special_ids and not any(c in hidden for c in text[start:end])]
        restore = re.compile("|".join(map(re.escape, hidden)))
        pieces, start = [], 0
        for begin, end, _ in marks:
            pieces.append(text[start:begin])
            start = end
        pieces.append(text[start:])
        pieces = [restore.sub(lambda m: hidden[m.group(0)], p) for p in pieces]
        encoded = self._text_backend().encode_batch(pieces, add_special_tokens=False)
        ids = list(encoded[0].ids)
        for (_, _, special), piece in zip(marks, encoded[1:]):
            ids.append(special)
            ids.extend(piece.ids)
        return ids

    def _text_backend(self):
        with self._lock:  # a copy, not a toggled flag: other threads encode with the original meanwhile
            if self._as_text is None:
                copy = Backend.from_str(self.backend.to_str())
                copy.encode_special_tokens = True
                self._as_text = copy
            return self._as_text


def _content_texts(messages):
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            if isinstance(content, str):
                yield content
            elif isinstance(content, list):
                yield from (p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def _map_content(message, swap):
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": swap(content)}
    if isinstance(content, list):
        parts = [{**p, "text": swap(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                 for p in content]
        return {**message, "content": parts}
    return message
