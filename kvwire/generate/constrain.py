"""Constrained decoding: a row's output must match a JSON schema, a regex or a grammar.

A `Constraint` is compiled once per tokenizer by llguidance (an Earley parser over the
tokenizer's vocabulary) into a matcher; each constrained row holds its own copy, which gives the
set of tokens allowed next as a bitmask. The engine masks the logits of the constrained rows
before sampling, so rows with and without constraints, and with different ones, share one batch
and one graph call: the mask is a per-row input of the sampler, not of the graph.

What the finish reasons then mean: "stop" (an end-of-turn token, allowed only where the grammar
accepts, or the grammar can go no further) is a complete, valid output; "length" (the budget
ended first) is a valid prefix of one. Log-probabilities are those of the masked distribution
(what the row was sampled from).

Example:
    >>> c = Constraint.json_schema({"type": "object", "properties": {"age": {"type": "integer"}},
    ...                             "required": ["age"]})
    >>> lm.generate("Alice is 30. As JSON:", json_schema=c.source)
    '{"age": 30}'
"""
import json
import threading
import time
import weakref

import numpy as np
import torch

from .request import RequestError

KINDS = ("json_schema", "json_object", "regex", "grammar")
# whitespace JSON may hold between tokens: none, a space, or a newline and up to 20 spaces or tabs of
# indent (llama.cpp's choice). Unbounded whitespace lets a small model spend its budget on blanks; a
# schema's own "x-guidance" options override this.
JSON_WHITESPACE = {"whitespace_pattern": r"( |\n[ \t]{0,20})?"}
_tokenizers = weakref.WeakKeyDictionary()  # kvwire Tokenizer -> {vocab_size: Vocabulary}
_lock = threading.Lock()


class ConstraintError(RequestError):
    """A schema, regex or grammar llguidance cannot compile; the message says which part."""


class Constraint:
    """What a generated row must match.

    Make one with `Constraint.json_schema(schema)`, `.json_object()`, `.regex(pattern)` or
    `.grammar(text)` (Lark, as llguidance reads it, or llama.cpp's GBNF). `param` names the request
    field in errors ("response_format", "json_schema").

    Example:
        >>> engine.submit(ids, 64, constraint=Constraint.regex(r"[0-9]{3}-[0-9]{4}"))
    """

    def __init__(self, kind, source, param=None):
        if kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.source, self.param = kind, source, param or kind
        self._compiled = []  # (Vocabulary, a fresh LLMatcher to copy per row), one per vocabulary seen

    @classmethod
    def json_schema(cls, schema, param="json_schema"):
        """Output is JSON valid against `schema` (a dict, a JSON string, or a pydantic model class)."""
        if hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"{param} is not valid JSON ({e}); expected a JSON schema", param) from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
        return cls("json_schema", schema, param)

    @classmethod
    def json_object(cls, param="response_format"):
        """Output is one JSON object (any keys)."""
        return cls("json_object", {"type": "object"}, param)

    @classmethod
    def regex(cls, pattern, param="regex"):
        """Output matches `pattern` whole (Rust regex syntax)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"{param} must be a non-empty str, got {pattern!r:.60}", param)
        return cls("regex", pattern, param)

    @classmethod
    def grammar(cls, text, param="grammar"):
        """Output is a sentence of a Lark grammar (llguidance's dialect, `start:` its first rule) or a
        GBNF grammar (`root ::= ...`, converted to Lark)."""
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(f"{param} must be a non-empty grammar text, got {text!r:.60}", param)
        return cls("grammar", text, param)

    def llguidance_grammar(self):
        """The grammar as llguidance's JSON definition."""
        from llguidance import LLMatcher, grammar_from

        if self.kind in ("json_schema", "json_object"):
            try:
                return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_WHITESPACE)
            except ValueError as e:
                raise ConstraintError(f"{self.param}: {e}", self.param) from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        try:
            return grammar_from("grammar", self.source)  # Lark as is, GBNF converted
        except ValueError as e:
            raise ConstraintError(f"{self.param}: {e}", self.param) from None

    def compile(self, tokenizer, vocab_size):
        """Check and compile for `tokenizer` (a kvwire Tokenizer) over `vocab_size` logits; cached,
        so `matcher` is then cheap. Takes up to ~100 ms for large schemas: call it off an event loop.
        Raises `ConstraintError` naming what llguidance could not compile."""
        self._fresh(tokenizer, vocab_size)
        return self

    def _fresh(self, tokenizer, vocab_size):
        """(Vocabulary, the compiled LLMatcher at the start) for this tokenizer and size."""
        from llguidance import LLMatcher

        vocab = vocabulary(tokenizer, vocab_size)
        found = next((m for v, m in self._compiled if v is vocab), None)  # identity: ids of freed ones recur
        if found is None:
            ll = vocab.ll
            grammar = self.llguidance_grammar()
            error = LLMatcher.validate_grammar(grammar, ll)
            if error:
                raise ConstraintError(f"{self.param}: the {self.kind.replace('_', ' ')} cannot be compiled: "
                                      f"{error.strip()}", self.param)
            found = LLMatcher(ll, grammar, log_level=0)
            if found.is_error():
                raise ConstraintError(f"{self.param}: {found.get_error()}", self.param)
            self._compiled.append((vocab, found))
        return vocab, found

    def matcher(self, tokenizer, vocab_size):
        """A new `RowMatcher` at the start of the output."""
        vocab, start = self._fresh(tokenizer, vocab_size)
        return RowMatcher(start.deep_copy(), vocab)

    def __repr__(self):
        shown = json.dumps(self.source) if not isinstance(self.source, str) else self.source
        return f"Constraint.{self.kind}({shown:.60})"


class Vocabulary:
    """llguidance's view of a kvwire Tokenizer's vocabulary over `size` logits (`ll`), and the ids it
    treats as special (`specials`, found on first use)."""

    def __init__(self, ll, size):
        self.ll, self.size, self._specials = ll, size, None

    @property
    def specials(self):
        if self._specials is None:
            self._specials = np.array([t for t in range(self.size) if self.ll.is_special_token(t)], dtype=np.int64)
        return self._specials


def vocabulary(tokenizer, vocab_size):
    """The `Vocabulary` of a kvwire Tokenizer padded to the model's `vocab_size` logits; built once
    per tokenizer (~0.3 s for 49k tokens, ~2 s for 262k)."""
    from llguidance import LLTokenizer

    if tokenizer is None:
        raise RequestError("constrained decoding needs the model's tokenizer; this model has none", "constraint")
    with _lock:
        per_size = _tokenizers.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            eos = list(tokenizer.eos_token_ids) or None
            ll = LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
            per_size[vocab_size] = Vocabulary(ll, vocab_size)
        return per_size[vocab_size]


def ll_tokenizer(tokenizer, vocab_size):
    """llguidance's LLTokenizer for a kvwire Tokenizer (see `vocabulary`)."""
    return vocabulary(tokenizer, vocab_size).ll


class RowMatcher:
    """One row's place in its grammar: which tokens may come next, and the tokens it took."""

    def __init__(self, matcher, vocab):
        self.m, self.vocab, self.vocab_size, self.ll = matcher, vocab, vocab.size, vocab.ll

    def allowed(self, stop_ids):
        """(V,) bool numpy array: tokens the grammar allows next. The row's stop ids are allowed
        exactly where the output so far is complete (the grammar accepts)."""
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        self._without_refused_specials(allowed, stop_ids)
        if stop_ids:
            allowed[list(stop_ids)] = self.m.is_accepting()
        return allowed

    def _without_refused_specials(self, allowed, stop_ids):
        """Where the grammar forces text that an added token spells (Qwen's "<tool_call>" written out
        in a regex), llguidance's mask offers that token's id, which it then refuses as special:
        such ids are dropped, and when nothing is left the forced text's first non-special token
        is allowed instead."""
        specials = self.vocab.specials
        offered = [int(t) for t in specials[allowed[specials]] if int(t) not in stop_ids]
        refused = [t for t in offered if self.m.validate_tokens([t]) == 0]
        if not refused:
            return
        allowed[refused] = False
        if not allowed.any():
            forced = self.m.compute_ff_bytes().decode("utf-8", "ignore")
            for t in self.ll.greedy_tokenize(forced)[:1] if forced else []:
                allowed[t] = self.m.validate_tokens([t]) == 1

    def take(self, token):
        """Advance by a sampled token; False when the grammar refused it (an error state)."""
        return self.m.consume_token(int(token))

    @property
    def finished(self):
        """The grammar can take nothing more (the output is complete)."""
        return self.m.is_stopped()

    @property
    def error(self):
        return self.m.get_error() if self.m.is_error() else None


def mask_logits(logits, seqs):
    """Logits (B, V) with every constrained row's disallowed tokens at -inf (a copy when any row is
    constrained). Returns (logits, rows that have no allowed token: [(i, why)]), seconds spent."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return logits, [], 0.0
    start = time.perf_counter()
    allowed = np.ones((len(rows), logits.shape[-1]), dtype=bool)
    stuck = []
    for j, i in enumerate(rows):
        matcher = seqs[i].matcher
        allowed[j] = matcher.allowed(seqs[i].stopper.stop_ids)
        if matcher.error is not None or not allowed[j].any():
            stuck.append((i, matcher.error or "the grammar allows no token here"))
    logits = logits.clone()
    block = torch.from_numpy(~allowed).to(logits.device)
    logits[rows] = logits[rows].masked_fill(block, float("-inf"))
    return logits, stuck, time.perf_counter() - start


def from_options(json_schema=None, regex=None, grammar=None):
    """The `Constraint` that generate's options ask for (at most one of them), or None."""
    given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
             if value is not None}
    if len(given) > 1:
        raise RequestError(f"give one of json_schema, regex and grammar; got {sorted(given)}", sorted(given)[1])
    if not given:
        return None
    (name, value), = given.items()
    if isinstance(value, Constraint):
        return value
    return {"json_schema": Constraint.json_schema, "regex": Constraint.regex, "grammar": Constraint.grammar}[name](value)
