"""A choice's text, log-probabilities and usage as OpenAI's JSON writes them, from an engine `Sequence`."""
import math

from ..generate.methods import visible_text
from ..generate.loop import Stopper


class ChoiceText:
    """One choice's text as its sequence grows: `update()` returns the new piece that is safe to show
    (stop strings and characters still being assembled held back, as `lm.stream`) and the tokens the
    text shown so far covers (for log-probabilities, with track_tokens). Once the sequence is done, the pieces add up to
    the final text: the decoded tokens cut at the first stop string.

    Example:
        >>> text = ChoiceText(lm.tokenizer, stops=("\\n\\n",))
        >>> piece, (first, last) = text.update(seq)   # tokens first..last-1 are now covered
    """

    def __init__(self, tokenizer, stops=(), track_tokens=False, keep_special=False):
        self.tokenizer, self.stops, self.track = tokenizer, tuple(stops), track_tokens
        self.skip = not keep_special  # kept: a tool call's markers may be special tokens
        self.sent, self.covered, self.offsets = "", 0, []
        self.final = False  # whether the last update saw the sequence done (its text is then whole)

    def update(self, seq):
        # `done` first: the engine thread appends a sequence's last token before marking it done,
        # so tokens copied after seeing done are complete (read the other way round, the last token
        # could be missing from the final text)
        done = self.final = seq.done
        tokens = list(seq.tokens)  # a copy: the engine thread may append meanwhile
        text = self.tokenizer.decode(tokens, skip_special_tokens=self.skip)
        if done:
            cut = Stopper((), self.stops).cut(text)
            text = text if cut is None else text[:cut]
        else:
            text = visible_text(text, self.stops)
        piece = ""
        if text.startswith(self.sent) and len(text) > len(self.sent):
            piece, self.sent = text[len(self.sent):], text
        first = self.covered
        # a token is covered once the text shown holds all of its characters
        while self.track and self.covered < len(tokens):  # decodes prefixes: only when logprobs are asked
            end = len(self.tokenizer.decode(tokens[:self.covered + 1], skip_special_tokens=self.skip))
            if end > len(self.sent):
                break
            self.offsets.append(len(self.tokenizer.decode(tokens[:self.covered], skip_special_tokens=self.skip)))
            self.covered += 1
        return piece, (first, self.covered)


def token_text(tokenizer, token):
    return tokenizer.decode([token], skip_special_tokens=False)


def _finite(logprob):
    return logprob if math.isfinite(logprob) else -9999.0  # JSON has no -inf; OpenAI's floor


def chat_logprobs(tokenizer, seq, span):
    """`choices[].logprobs` of a chat completion (chunk) for tokens span[0]..span[1]-1."""
    entries = []
    for i in range(*span):
        tops = seq.top_logprobs[i] if seq.top_logprobs else []
        entries.append({**_entry(tokenizer, seq.tokens[i], seq.logprobs[i]),
                        "top_logprobs": [_entry(tokenizer, t, lp) for t, lp in tops]})
    return {"content": entries, "refusal": None}


def _entry(tokenizer, token, logprob):
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def completion_logprobs(tokenizer, seq, span, offsets, top):
    """`choices[].logprobs` of a (legacy) completion for tokens span[0]..span[1]-1; `offsets` are
    the tokens' character offsets in the choice's text."""
    tokens = [token_text(tokenizer, seq.tokens[i]) for i in range(*span)]
    return {"tokens": tokens, "token_logprobs": [_finite(seq.logprobs[i]) for i in range(*span)],
            "top_logprobs": [{token_text(tokenizer, t): _finite(lp) for t, lp in seq.top_logprobs[i]}
                             for i in range(*span)] if top else None,
            "text_offset": [offsets[i] for i in range(*span)]}


def usage(seqs, n):
    """OpenAI's usage over a request's sequences (`n` choices per prompt: a prompt counts once)."""
    firsts = seqs[::n]
    prompt = sum(len(s.prompt) for s in firsts)
    completion = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}
