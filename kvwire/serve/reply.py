"""One request's answer in OpenAI's shapes: whole (JSON, once its sequences are done) or streamed
(server-sent events as tokens arrive), with log-probabilities, tool calls read from the text, and
a log line with its timings."""
import json
import logging
import time

from fastapi.responses import JSONResponse, Response

from .errors import APIError
from .render import chat_logprobs, completion_logprobs, usage

log = logging.getLogger("kvwire.serve")


class Reply:
    """One request's answer: whole (JSON) or streamed (server-sent events)."""

    def __init__(self, handlers, kind, rid, body, run, texts, n, logprobs, top, done=None, tools=None):
        self.h, self.kind, self.rid, self.body, self.run, self.texts = handlers, kind, rid, body, run, texts
        self.n, self.logprobs, self.top, self.tools = n, logprobs, top, tools
        # streamed choices' tool calls, read as the text arrives (None: calls are not read)
        self.calls = [tools.stream() if tools is not None else None for _ in run.seqs]
        self.done = done or (lambda: None)  # called once the rows are finished or cancelled
        self.created, self.started = int(time.time()), time.perf_counter()

    async def whole(self, request):
        try:
            async for _ in self.run.updates():
                if await request.is_disconnected():
                    self.run.cancel()
                    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        finally:
            self._log()
            self.done()
        failed = next((s for s in self.run.seqs if s.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(f"generation failed: {failed.error}", status=500, type="server_error", code="generation_failed")
        choices = []
        for i, (seq, text) in enumerate(zip(self.run.seqs, self.texts)):
            piece, span = text.update(seq)
            content = self._content(i, text.sent, span, whole=True)
            reason = seq.finish_reason
            if self.tools is not None:
                content["message"], reason = self.tools.message(text.sent, reason)
            choices.append({"index": i, **content, "finish_reason": reason})
        return JSONResponse({**self._head(), "choices": choices, "usage": usage(self.run.seqs, self.n)})

    async def events(self):
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        finished = set()
        try:
            if self.kind == "chat.completion":
                yield _sse({**self._head(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}
                                                        for i in range(len(self.run.seqs))], **extra})
            async for changed in self.run.updates():
                for i in sorted(changed - finished):
                    seq = self.run.seqs[i]
                    if seq.finish_reason == "error":
                        yield _sse(APIError(f"generation failed: {seq.error}", type="server_error",
                                            code="generation_failed").body())
                        return
                    piece, span = self.texts[i].update(seq)
                    for content in self._pieces(i, piece, span):
                        yield _sse({**self._head(), "choices": [{"index": i, **content, "finish_reason": None}],
                                    **extra})
                    if self.texts[i].final:  # what update saw: a sequence done after it is sent next round
                        finished.add(i)
                        reason = seq.finish_reason
                        if self.calls[i] is not None and self.calls[i].calls and reason == "stop":
                            reason = "tool_calls"
                        yield _sse({**self._head(), "choices": [{"index": i, **self._content(i, "", (0, 0)),
                                                                 "finish_reason": reason}], **extra})
            if include_usage:
                yield _sse({**self._head(), "choices": [], "usage": usage(self.run.seqs, self.n)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _sse(e.body())
        finally:
            self.run.cancel()  # a client that went away (no-op for finished sequences)
            self._log()
            self.done()

    def _head(self):
        obj = self.kind + (".chunk" if self.body.stream and self.kind == "chat.completion" else "")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.h.model_name}

    def _pieces(self, i, piece, span):
        """The chunk contents for a choice's new text `piece` (covering tokens in span): its delta,
        or with tools, the deltas its tool-call reader gives (log-probabilities on the first)."""
        calls = self.calls[i]
        if calls is None:
            return [self._content(i, piece, span)] if piece or span[1] > span[0] else []
        deltas = calls.feed(piece) if piece else []
        if self.texts[i].final:
            deltas += calls.flush()
        if not deltas and span[1] > span[0]:
            deltas = [{}]
        out = []
        for j, delta in enumerate(deltas):
            content = self._content(i, "", span if j == 0 else (0, 0))
            content["delta"] = delta
            out.append(content)
        return out

    def _content(self, i, text, span, whole=False):
        """A choice's text (message, delta or text) and its log-probabilities for tokens in span."""
        seq, tok = self.run.seqs[i], self.h.tokenizer
        if self.kind == "chat.completion":
            lp = chat_logprobs(tok, seq, span) if self.logprobs else None
            if whole:
                return {"message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": lp}
            return {"delta": {"content": text} if text else {}, "logprobs": lp}
        lp = completion_logprobs(tok, seq, span, self.texts[i].offsets, self.top) if self.logprobs else None
        return {"text": text, "logprobs": lp}

    def _log(self):
        seqs = self.run.seqs
        firsts = [s.first_token_at for s in seqs if s.first_token_at is not None]
        ends = [s.finished_at for s in seqs if s.finished_at is not None]
        u = usage(seqs, self.n)
        ttft = f"{(min(firsts) - self.started) * 1000:.0f} ms" if firsts else "-"
        span = max(ends) - min(firsts) if firsts and ends else 0
        rate = f"{u['completion_tokens'] / span:.1f} tokens/s" if span > 0 else "-"
        # a sequence not done here was cancelled: its client went away
        reasons = ",".join(sorted({s.finish_reason or "cancelled" for s in seqs}))
        log.info("%s %s: prompt %d tokens (%d cached), completion %d tokens, first token %s, %s, finish %s",
                 self.rid, self.kind, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                 u["completion_tokens"], ttft, rate, reasons)


def _sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
