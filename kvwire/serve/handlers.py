"""What the two generation endpoints do: check and translate a request into engine sequences and
hand them to a `Reply` (`kvwire.serve.reply`), which waits for them or streams them."""
import asyncio
import threading
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..generate import request as checks
from ..generate.constrain import ll_tokenizer
from . import options
from .errors import APIError, from_request_error
from .render import ChoiceText
from .reply import Reply
from .schemas import unsupported
from .tool_use import ToolUse, uses_tools


class Handlers:
    """The endpoints' logic over one served model and its engine thread (see `create_app`)."""

    def __init__(self, lm, model_name, bridge, names, limits, inline=None, tool_fallback=True, sae=None,
                 clamped=frozenset):
        self.lm, self.model_name, self.bridge, self.names = lm, model_name, bridge, tuple(names)
        self.tokenizer, self.limits, self.inline, self.sae = lm.tokenizer, limits, inline, sae
        self.tool_fallback = tool_fallback
        self.clamped = clamped  # () -> the names of the served vectors made to clamp (they take bounds)
        # llguidance's view of the vocabulary takes ~0.3 s (49k tokens) to ~2 s (262k): built now, on a
        # thread, so the first request with a response_format does not wait for it
        threading.Thread(target=_warm_constraints, args=(lm.tokenizer, lm.vocab_size), daemon=True).start()

    def use(self, lm, names):
        """Serve a new steered model of the same base (a control vector was added); on the loop."""
        self.lm, self.names = lm, tuple(names)

    async def chat(self, body, request: Request):
        self._check(body)
        if body.top_logprobs is not None and not (0 <= body.top_logprobs <= 20 and body.logprobs):
            raise APIError(f"top_logprobs must be an int in [0, 20] and needs logprobs=true; got "
                           f"top_logprobs={body.top_logprobs}, logprobs={body.logprobs}", param="top_logprobs")
        if not body.messages:
            raise APIError("messages is empty; expected at least one message", param="messages", code="invalid_value")
        _text_only(body.messages)
        tools = None
        if uses_tools(body):
            try:
                tools = ToolUse(body, self.tokenizer, self.tool_fallback)
            except checks.RequestError as e:
                raise from_request_error(e) from None
            if tools.constraint is not None and body.response_format is not None and \
                    body.response_format.type != "text":
                raise APIError("response_format cannot be combined with a forced tool call (tool_choice "
                               f"{tools.choice!r}): the reply is the call", param="response_format")
        # rendering and tokenising take time in proportion to the text: on a worker thread, so
        # other clients' streams go on meanwhile (tokenizers releases the GIL while it encodes)
        ids = await asyncio.to_thread(self._chat_ids, body.messages, tools)
        self.limits.check_prompt(len(ids), "messages")
        stop_ids = tuple(self.lm.eos_token_ids) + tuple(self.tokenizer.end_of_turn_ids)
        top = body.top_logprobs or 0
        return await self._answer("chat.completion", "chatcmpl", body, [ids], stop_ids, bool(body.logprobs), top,
                                  request, tools=tools)

    async def complete(self, body, request: Request):
        self._check(body)
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise APIError(f"logprobs must be an int in [0, 5], got {body.logprobs}", param="logprobs")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts or any(not p for p in prompts):
            raise APIError(f"prompt must be a non-empty str or a non-empty list of them, got {body.prompt!r:.80}",
                           param="prompt", code="invalid_value")
        rows = await asyncio.to_thread(lambda: [self.tokenizer.encode(checks.unicode_text(p, "prompt"))
                                                for p in prompts])
        for ids in rows:
            self.limits.check_prompt(len(ids), "prompt")
        want = body.logprobs is not None
        return await self._answer("text_completion", "cmpl", body, rows, tuple(self.lm.eos_token_ids), want,
                                  body.logprobs or 0, request)

    def _chat_ids(self, messages, tools=None):
        """A conversation's prompt ids: its content as text, the template's markup as control tokens
        (see `Tokenizer.apply_chat_template`); with `tools` (a ToolUse), as its format renders them."""
        checks.message_texts(messages)
        try:
            variables = {}
            if tools is not None:
                messages, variables = tools.conversation()
            return self.tokenizer.apply_chat_template([_flatten(m) for m in messages], tokenize=True, **variables)
        except checks.RequestError as e:  # a malformed tool call or result (named by its field)
            raise from_request_error(e) from None
        except (ValueError, TypeError) as e:  # the template's (or its message checks') refusal
            raise APIError(self._without_origin(str(e)), param="messages", code="invalid_value") from None

    def _without_origin(self, message):
        """A template's refusal without where the template was read from (a path on this machine)."""
        origin = getattr(self.tokenizer.chat_template, "origin", None)
        return message.replace(origin, "the model's chat template") if origin else message

    def _inline(self, body):
        """The request's inline vectors, parsed and checked ([] when it has none)."""
        if not body.steer_vectors:
            return []
        if self.inline is None:
            raise APIError("this server takes no inline vectors (start it with --inline-slots K)",
                           param="steer_vectors", code="unsupported")
        return self.inline.parse(body.steer_vectors)

    def _features(self, body):
        """The request's SAE features, parsed and checked ([] when it has none)."""
        if not body.sae_features:
            return []
        if self.sae is None:
            raise APIError("this server has no SAE for sae_features (start it with --sae FOLDER)",
                           param="sae_features", code="unsupported")
        return self.sae.parse(body.sae_features, body.sae_mode)

    def _lend(self, inline, features, inputs):
        """Lend a slot per inline vector and per SAE feature: (row inputs with their values, prefix
        key, a function giving the slots back)."""
        slots, held = [], []
        try:
            for item in inline:
                slots.append(self.inline.acquire(item, taken=slots))
            held = self.sae.acquire(features) if features else []
        except APIError:
            if slots:
                self.inline.release(slots)
            raise
        inputs, key = dict(inputs), tuple(self.inline.digest(k) for k in slots)
        for slot, item in zip(slots, inline):
            inputs.update(self.inline.inputs(slot, item))
        if features:
            inputs.update(self.sae.inputs(held, features))
            key += self.sae.key(held, features)

        def give_back():  # once, whoever calls first (the reply's end or a failed submit)
            if slots:
                self.inline.release(slots)
            if held:
                self.sae.release(held)
            slots.clear()
            held.clear()
        return inputs, key, give_back

    def _check(self, body):
        if body.model is not None and body.model != self.model_name:
            raise APIError(f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", status=404)
        refused = unsupported(body)
        if refused is not None:
            raise APIError(refused[1], param=refused[0], code="unsupported")

    async def _answer(self, kind, prefix, body, rows, stop_ids, logprobs, top, request, tools=None):
        n = options.choices(body, len(rows))
        seed = checks.seed(body.seed, rows=n)  # choice j draws from seed + j: every one must fit
        sampler, stops = options.sampler(body), options.stop_strings(body)
        inputs = options.steer_inputs(body, self.names, self.clamped())
        constraint = (tools and tools.constraint) or options.constraint(body)
        if constraint is not None:
            if stops:
                raise APIError("stop cannot be combined with response_format (or a required tool call): the "
                               "grammar decides where the output ends", param="stop", code="invalid_value")
            # compiling a large schema takes up to ~100 ms (llguidance drops the GIL): off the loop
            try:
                await asyncio.to_thread(constraint.compile, self.tokenizer, self.bridge.engine.vocab_size)
            except checks.RequestError as e:
                raise from_request_error(e) from None
        inline, features, give_back = self._inline(body), self._features(body), _nothing
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        submits = []
        for ids in rows:
            vocab = self.bridge.engine.vocab_size  # read once by the engine: no Parameter read on the loop
            if ids and max(ids) >= vocab:
                raise APIError(f"the tokenizer gave id {max(ids)} but the model has {vocab} tokens",
                               status=500, type="server_error")
            new = options.budget(body, len(ids), self.bridge.engine.max_length, self.limits)
            for j in range(n):  # choice j of a prompt draws from seed + j, as generate's rows
                submits.append(dict(prompt=ids, max_new_tokens=new, sampler=sampler, stop_ids=stop_ids,
                                    seed=None if seed is None else seed + j, stop_strings=stops,
                                    inputs=inputs, logprobs=logprobs, top_logprobs=top, constraint=constraint,
                                    label=f"{rid} choice {len(submits)}"))
        if inline or features:  # last: slots are lent only to a request that passed every other check
            inputs, key, give_back = self._lend(inline, features, inputs)
            for s in submits:
                s.update(inputs=inputs, prefix_key=key)
        try:
            run = self.bridge.run(submits)
        except BaseException:
            give_back()
            raise
        keep = tools is not None and tools.keep_special
        texts = [ChoiceText(self.tokenizer, stops, track_tokens=logprobs, keep_special=keep) for _ in run.seqs]
        reply = Reply(self, kind, rid, body, run, texts, n, logprobs, top, give_back, tools)
        if body.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await reply.whole(request)


def _nothing():
    pass


def _warm_constraints(tokenizer, vocab_size):
    try:
        ll_tokenizer(tokenizer, vocab_size)
    except Exception:  # noqa: BLE001 - only a head start: a request builds it (and reports failures) itself
        pass


def _text_only(messages):
    """Refuse, naming the message, what a text-only model cannot take: non-text content parts
    (images, audio)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content} - {"text"})
            if kinds:
                raise APIError(f"messages[{i}].content: only text parts are supported (the model reads text); got "
                               f"parts of type {kinds}", param=f"messages[{i}].content", code="unsupported")


def _flatten(message):
    """A message whose content is text parts only ([{"type": "text", "text": ...}], as clients send
    it) as one string: text-only chat templates expect a str."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return {**message, "content": "\n".join(p["text"] for p in content)}
    return message
