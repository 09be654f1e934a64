"""Chat templates: the checkpoint's own jinja template, rendered as transformers renders it.

transformers compiles templates in an `ImmutableSandboxedEnvironment` (trim_blocks, lstrip_blocks,
loopcontrols) with its own `tojson`, `raise_exception` and `strftime_now`; the same is done here so a
prompt is byte-for-byte what transformers would build. Templates come from the Hub, so they are
untrusted: on top of the sandbox, repetition, concatenation, powers, `range` and the output are bounded.
"""
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# tokens that end an assistant turn in common templates (ChatML, Gemma, Llama 3, Phi 3, GPT-2 style,
# Mistral, gpt-oss, Cohere); one counts only if it is in the vocabulary and the template writes it
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "</s>", "<|return|>", "<|END_OF_TURN_TOKEN|>")
# names the renderer itself passes; a caller's variable may not shadow them
RESERVED = ("messages", "add_generation_prompt", "range")
_MAX_CHARS = 10_000_000  # longest string or list a template may build (a chat prompt is far shorter)
_MAX_RANGE = 1_000_000  # total `range` items one render may iterate (nested loops share it)


class ChatTemplate:
    """A chat template compiled once; `render` turns messages into the prompt text.

    Args:
        source: the jinja template text (GGUF `tokenizer.chat_template`, tokenizer_config.json's
            `chat_template` or a `chat_template.jinja` file).
        origin: where it came from, named in errors (e.g. "model.gguf: tokenizer.chat_template").

    Example:
        >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
        >>> t.render([{"role": "user", "content": "Hi"}])
        '<user>Hi'
    """

    def __init__(self, source, origin="chat template"):
        if not isinstance(source, str):
            raise TypeError(f"{origin}: a chat template must be a str, got {type(source).__name__}")
        self.source, self.origin = source, origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template does not compile: {e.message} (line {e.lineno})") from e

    def render(self, messages, add_generation_prompt=False, **variables):
        """messages (a list of {"role", "content"} dicts) -> the prompt text.

        `variables` reach the template as they do in transformers (`tools`, `documents`, `bos_token`,
        custom flags); `tools` and `documents` default to None. A template's `raise_exception(msg)`
        becomes a ValueError carrying msg.
        """
        messages = _checked_messages(messages)
        shadowed = sorted(set(variables) & set(RESERVED))
        if shadowed:
            raise ValueError(f"template variables {shadowed} are set by the renderer; pass other names")
        variables = {"tools": None, "documents": None, **variables}
        _check_dicts(variables["tools"], "tools")
        _check_dicts(variables["documents"], "documents")
        budget = [_MAX_RANGE]
        try:
            chunks, size = [], 0
            for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 range=lambda *a: _budgeted_range(budget, *a), **variables):
                size += len(chunk)
                if size > _MAX_CHARS:
                    raise _Limit(f"the prompt passed {_MAX_CHARS} characters")
                chunks.append(chunk)
            return "".join(chunks)
        except _Raised as e:
            raise ValueError(f"{self.origin} refused the conversation: {e.message}") from None
        except _Limit as e:
            raise ValueError(f"{self.origin}: rendering stopped: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError,
                RecursionError) as e:  # a template bug or a limit, never a crash
            raise ValueError(f"{self.origin}: rendering failed: {type(e).__name__}: {e}") from None

    def __repr__(self):
        return f"ChatTemplate({len(self.source)} characters from {self.origin})"


class _Raised(jinja2.TemplateError):
    """What a template's raise_exception(msg) raises."""


class _Limit(jinja2.exceptions.SecurityError):
    """A template went past a size bound."""


class _Environment(ImmutableSandboxedEnvironment):
    # checked before running: `'x' * 10**9`, doubling in a loop or `9 ** 9 ** 9` would exhaust memory or time
    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context, op, left, right):
        if op == "**" and isinstance(right, int) and abs(right) > 256 and not isinstance(left, float):
            raise _Limit(f"{left!r} ** {right} is too large to compute")
        if op == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if op == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            _check_size(len(left) * right)
        if op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            _check_size(len(left) + len(right))
        return super().call_binop(context, op, left, right)


class _Generation(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' training masks;
    # rendering keeps the body as it is
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment():
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: unlike jinja's own, it keeps non-ASCII and does not HTML-escape
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise _Raised(str(message))


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _budgeted_range(budget, *args):
    items = range(*args)  # range itself checks the arguments
    budget[0] -= len(items)
    if budget[0] < 0:
        raise _Limit(f"the template iterates more than {_MAX_RANGE} range items")
    return items


def _check_size(n):
    if n > _MAX_CHARS:
        raise _Limit(f"the template builds a value of {n} items (at most {_MAX_CHARS} allowed)")


def _checked_messages(messages):
    """Plain copies of the messages, checked; keys holding None are dropped, as transformers does
    (clients send content=None beside tool_calls, and templates test whether keys are defined)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        got = f"an empty {type(messages).__name__}" if isinstance(messages, (list, tuple)) else \
            type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts; got {got}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content'; got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}]['role'] must be a str; got {_kind(message.get('role'))}")
        content = message.get("content")
        if content is None and "tool_calls" not in message:
            raise ValueError(f"messages[{i}] has no 'content' (only a message with 'tool_calls' may omit it)")
        if content is not None and not isinstance(content, str) and not _is_parts(content):
            raise ValueError(f"messages[{i}]['content'] must be a str or a list of parts like "
                             f"{{'type': 'text', 'text': ...}}; got {_kind(content)}")
        checked.append(_aliased_reasoning(json.loads(json.dumps(message, default=_not_json(i)))))
    return checked


def _is_parts(content):
    return isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)


def _not_json(i):
    def refuse(value):
        raise TypeError(f"messages[{i}] holds a {type(value).__name__}; "
                        f"expected JSON data (str, numbers, lists, dicts)")
    return refuse


def _aliased_reasoning(message):
    # transformers fills `reasoning_content` (and gpt-oss's `thinking`) from whichever reasoning key is set
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _check_dicts(values, name):
    if values is not None and not (isinstance(values, (list, tuple)) and all(isinstance(v, dict) for v in values)):
        raise TypeError(f"{name} must be a list of dicts (JSON schemas for tools, {{'title', 'text'}} for documents); "
                        f"got {_kind(values)}")


def _kind(value):
    return "nothing" if value is None else type(value).__name__


def template_from_gguf(path, field):
    """The GGUF `tokenizer.chat_template` of a file, or None if it has none."""
    source = field("tokenizer.chat_template")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{path}: tokenizer.chat_template must be a string; got {type(source).__name__}")
    return ChatTemplate(source, f"{path}: tokenizer.chat_template")


def template_from_hf_folder(folder, settings, settings_path):
    """A checkpoint folder's template, or None: `chat_template.jinja` (transformers v5 writes it, and
    it wins, as in transformers) else tokenizer_config.json's `chat_template` (a str, or a list of
    {"name", "template"} of which "default" is used)."""
    jinja_path = Path(folder) / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return ChatTemplate(jinja_path.read_text(encoding="utf-8"), str(jinja_path))
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja_path} is not UTF-8 text: {e}") from e
    source = settings.get("chat_template")
    origin = f"{settings_path}: chat_template"
    if source is None or isinstance(source, str):
        return None if source is None else ChatTemplate(source, origin)
    named = isinstance(source, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                             and isinstance(t.get("template"), str) for t in source)
    if not named:
        raise ValueError(f"{origin} must be a string or a list of {{'name', 'template'}} strings; "
                         f"got {type(source).__name__}")
    templates = {t["name"]: t["template"] for t in source}
    if "default" not in templates:
        raise ValueError(f"{origin} names templates {sorted(templates)} but none is 'default'")
    return ChatTemplate(templates["default"], f"{origin} (default)")


def token_strings(settings, settings_path):
    """The special token strings tokenizer_config.json names (`bos_token`, `eos_token`, ...), each a
    str or an AddedToken dict {"content": ...}, as transformers reads them."""
    strings = {}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = settings.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{settings_path}: {name} = {value!r}; expected a string or {{'content': string}}")
        if value is not None:
            strings[name] = value
    return strings


def template_end_of_turn_ids(backend, template):
    """Ids of the END_OF_TURN_TOKENS in the vocabulary that `template` writes (none without a template)."""
    if template is None:
        return ()
    ids = (backend.token_to_id(t) for t in END_OF_TURN_TOKENS if t in template.source)
    return tuple(i for i in ids if i is not None)


def template_from_transformers(tokenizer):
    """A transformers tokenizer's `chat_template` (a str, or a dict of named ones: "default"), or None."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("default")
    return None if source is None else ChatTemplate(source, f"{type(tokenizer).__name__}.chat_template")
