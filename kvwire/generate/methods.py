"""The generation methods every model offers (`generate`, `stream`, `chat`, `score`), written once
over the `Runner` a model gives: `CausalLM` (eager or compiled) and `ExportedLM` (a runtime) share
them. Requests are checked by `kvwire.generate.request`; rows run in the engine (beam search in a
`Session` of its own)."""
import torch

from . import constrain, request
from .engine import Engine
from .loop import Generation, Stopper, beam_search, finish
from .samplers import BeamSearch
from .session import Session


class GenerationMethods:
    """Mixed into a model class that provides `runner()`, `tokenizer`, `vocab_size`, `device`,
    `max_context` and, for `score`, uncached logits through `self(ids)`."""

    _prefix_store = None

    def generate(self, prompt, max_new_tokens=None, max_length=None, *, sampler=None, seed=None, stop=(),
                 stop_token_ids=(), repetition_penalty=None, ignore_eos=False, return_logprobs=False, inputs=None,
                 json_schema=None, regex=None, grammar=None):
        """Continue `prompt` through the cached graph.

        Args:
            prompt: a str, a list of str (a batch, left-padded), or token ids: a 1-D tensor, a 2-D
                (B, T) tensor, or a list of 1-D tensors of different lengths (left-padded).
            max_new_tokens: tokens to generate at most (default 32 when max_length is not given).
            max_length: prompt + new tokens at most (the longest prompt of a batch counts).
                With both, the smaller limit wins.
            sampler: kw.Greedy() (default), kw.Random, kw.TopK, kw.TopP, kw.MinP or kw.BeamSearch.
            seed: seeds the sampler's random generator (same seed, same output); row i uses seed + i.
            stop: stop strings; a row ends once its text contains one, which is not returned.
            stop_token_ids: extra ids that end a row (besides the model's end-of-sequence ids).
            repetition_penalty: > 0; transformers' penalty on tokens already in the row.
            ignore_eos: do not stop at end-of-sequence ids (benchmarks).
            return_logprobs: return the `Generation` record (ids, texts, chosen tokens'
                log-probabilities, timings) instead of the continuation alone.
            inputs: values for the cached graph's runtime inputs, {name: (B,) tensor}, e.g.
                {"steer_strength": torch.tensor([4.0, 0.0])}; others take their defaults.
            json_schema: the output must be JSON valid against this schema (a dict, a JSON string
                or a pydantic model class); regex: must match this pattern; grammar: must be a
                sentence of this Lark or GBNF grammar (at most one of the three; see
                `kvwire.generate.constrain`). A row then ends where its output is complete; one cut
                by max_new_tokens is a valid prefix.

        Returns:
            The continuation only: str for a str, list of str for a list, a 1-D id tensor for a
            1-D tensor, a list of 1-D id tensors for a 2-D tensor or a list of 1-D tensors.

        Example:
            >>> lm.generate("The capital of France is", max_new_tokens=8)
            >>> lm.generate(["Hello", "Once upon a time"], sampler=kw.TopP(0.9), seed=1)
            >>> lm.generate("Alice is 30.", json_schema={"type": "object", "properties": {"age": {"type": "integer"}}})
        """
        rows = request.prompt_rows(prompt, self.encode, self.vocab_size)
        text = not isinstance(prompt, torch.Tensor)  # the record carries texts unless ids came as one tensor
        gen = _last(self._start(rows, max_new_tokens, max_length, text=text, logprobs=return_logprobs,
                                sampler=sampler, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
                                repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, inputs=inputs,
                                json_schema=json_schema, regex=regex, grammar=grammar))
        if return_logprobs:
            return gen
        if isinstance(prompt, str):
            return gen.texts[0]
        if isinstance(prompt, torch.Tensor) or request.is_id_row(prompt[0]):
            device = prompt.device if isinstance(prompt, torch.Tensor) else prompt[0].device  # as given
            out = [torch.tensor(t, dtype=torch.long, device=device) for t in gen.tokens]
            return out[0] if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 else out
        return gen.texts

    def generate_ids(self, prompt, max_new_tokens=None, max_length=None, **options):
        """Like `generate(..., return_logprobs=True)`: the `Generation` record."""
        return self.generate(prompt, max_new_tokens, max_length, return_logprobs=True, **options)

    def stream(self, prompt, max_new_tokens=None, max_length=None, **options):
        """Yield the continuation of a str prompt as text pieces while tokens are produced.

        A character whose bytes span several tokens is yielded whole; text that may be the start
        of a stop string is held back until it is not. The pieces concatenate to `generate`'s text.
        Options are those of `generate` (beam search excluded).

        Example:
            >>> for piece in lm.stream("Once upon a time", max_new_tokens=20):
            ...     print(piece, end="", flush=True)
        """
        return (piece for piece, _ in self._stream(prompt, max_new_tokens, max_length, False, options))

    def stream_with_record(self, prompt, max_new_tokens=None, max_length=None, logprobs=True, **options):
        """Like `stream`, yielding (piece, the `Generation` record so far) for timings and ids;
        logprobs=False leaves the record's log-probabilities NaN and skips computing them."""
        return self._stream(prompt, max_new_tokens, max_length, logprobs, options)

    def chat(self, messages, max_new_tokens=None, max_length=None, *, stream=False, reuse_prefix=True, **options):
        """The assistant's reply to a conversation, rendered with the model's own chat template.

        Args:
            messages: [{"role": "system" | "user" | "assistant", "content": str}, ...] as the
                template accepts them (see `tokenizer.apply_chat_template`).
            stream: yield the reply as text pieces instead of returning it whole.
            reuse_prefix: keep this conversation's keys/values in `lm.prefix_store`, so the next
                turn (these messages, the reply and a new message) prefills only what is new.
            options: those of `generate` (sampler, seed, stop, inputs, ...; beam search excluded).

        The reply ends at the template's end-of-turn token (e.g. <|im_end|>) or an end-of-sequence id.

        Example:
            >>> lm = kw.load("smollm2-135m-instruct")
            >>> messages = [{"role": "user", "content": "Name three colours."}]
            >>> reply = lm.chat(messages, max_new_tokens=40)
            >>> messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And two more?"}]
            >>> for piece in lm.chat(messages, stream=True):   # the first turn is not prefilled again
            ...     print(piece, end="")
        """
        if self.tokenizer is None:
            raise request.RequestError("this model has no tokenizer, so it has no chat template; use generate "
                                       "with token ids", "messages")
        if isinstance(options.get("sampler"), BeamSearch):
            raise request.RequestError("chat samples (kw.Greedy, kw.TopP, ...); beam search runs through generate",
                                       "sampler")
        request.message_texts(messages)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        request.checked_vocab(ids, self.vocab_size, "the chat template's tokens reach id {}")
        run = self._start([ids], max_new_tokens, max_length, text=True, **options,
                          extra_stop_ids=self.tokenizer.end_of_turn_ids,
                          prefix_store=self.prefix_store if reuse_prefix else None)
        if stream:
            return (piece for piece, _ in self._pieces(run, options))
        return _last(run).texts[0]

    @property
    def prefix_store(self):
        """The `PrefixStore` that `chat` keeps conversations' keys/values in (made on first use)."""
        if self._prefix_store is None:
            from .prefix import PrefixStore

            self._prefix_store = PrefixStore()
        return self._prefix_store

    def encode(self, text):
        """`text`'s token ids (list of int), checked: a non-empty str, ids inside the vocabulary."""
        return request.encoded(self.tokenizer, text, self.vocab_size)

    def score(self, text_or_ids):
        """Log-probability of every token given the ones before it, in one uncached pass.

        Args:
            text_or_ids: a str (encoded with BOS when the tokenizer adds one) or a 1-D token-id tensor.

        Returns:
            A float tensor (T - 1,): entry t is log p(token[t+1] | token[:t+1]).

        Example:
            >>> lm.score("The capital of France is Paris").sum()
        """
        ids = self._ids_for_scoring(text_or_ids).to(self.device)
        with torch.inference_mode():
            logp = torch.log_softmax(self(ids[None])[0, :-1].float(), -1)
        return logp.gather(1, ids[1:, None])[:, 0]

    def perplexity(self, text_or_ids):
        """exp of the mean negative log-likelihood of `score`."""
        return float(torch.exp(-self.score(text_or_ids).mean()))

    def _ids_for_scoring(self, text_or_ids):
        if isinstance(text_or_ids, str):
            ids = torch.tensor(self.encode(text_or_ids), dtype=torch.long, device=self.device)
        else:
            ids = text_or_ids
            request.id_tensor(ids, self.vocab_size)
            if ids.dim() != 1:
                raise request.RequestError(f"score expects a 1-D token-id tensor, got shape {tuple(ids.shape)}",
                                           "text_or_ids")
        if len(ids) < 2:
            raise request.RequestError(f"score needs at least 2 tokens, got {len(ids)}", "text_or_ids")
        return ids

    def _stream(self, prompt, max_new_tokens, max_length, logprobs, options):
        """Checks the request now (a bad option raises before anything is yielded or printed) and
        returns the generator of (piece, record) pairs."""
        if not isinstance(prompt, str):
            raise TypeError(f"stream expects a str prompt, got {type(prompt).__name__}")
        if isinstance(options.get("sampler"), BeamSearch):
            raise request.RequestError("stream does not support beam search (the best beam is known only at the "
                                       "end)", "sampler")
        rows = [self.encode(prompt)]
        return self._pieces(self._start(rows, max_new_tokens, max_length, text=True, logprobs=logprobs, **options),
                            options)

    def _pieces(self, run, options):
        sent = ""
        for gen in run:
            text = gen.texts[0] if gen.finished else visible_text(self.tokenizer.decode(gen.tokens[0]),
                                                               options.get("stop", ()))
            if text.startswith(sent) and len(text) > len(sent):
                yield text[len(sent):], gen
                sent = text

    def _start(self, rows, max_new_tokens, max_length, *, text, logprobs=True, sampler=None, seed=None, stop=(),
               stop_token_ids=(), repetition_penalty=None, ignore_eos=False, inputs=None, extra_stop_ids=(),
               prefix_store=None, json_schema=None, regex=None, grammar=None):
        """Check a request of token-id `rows` and start it: an iterator of growing `Generation`
        records, the last one finished (beam search yields only the finished one). logprobs=False:
        the records' log-probabilities are NaN (sampling skips computing them). `text`: decode
        the rows' texts at the end."""
        runner = self.runner()
        longest = max(len(r) for r in rows)
        new = request.new_tokens(longest, max_new_tokens, max_length, context=runner.max_context)
        sampler, seed = request.sampler(sampler), request.seed(seed, rows=len(rows))
        stop = request.stop_strings(stop)
        if stop and runner.tokenizer is None:
            raise request.RequestError("stop strings need a tokenizer; this model has none", "stop")
        repetition_penalty = request.repetition_penalty(repetition_penalty)
        stop_ids = request.stop_token_ids(stop_token_ids, runner.vocab_size) \
            + (() if ignore_eos else tuple(runner.eos_token_ids)) + tuple(extra_stop_ids)
        stopper = Stopper(stop_ids, stop, runner.tokenizer if text or stop else None)
        constraint = constrain.from_options(json_schema, regex, grammar)
        if constraint is not None:
            if isinstance(sampler, BeamSearch):
                raise request.RequestError("constrained decoding samples row by row (kw.Greedy, kw.TopP, ...); "
                                           "beam search does not take json_schema, regex or grammar", "sampler")
            constraint.compile(runner.tokenizer, runner.vocab_size)  # a bad schema raises before any work
        if isinstance(sampler, BeamSearch):
            if stop:
                raise request.RequestError("stop strings are not supported with beam search", "stop")
            session = Session(runner.graph, runner.head, rows, runner.cache_length(longest + new), inputs=inputs,
                              multiple=runner.multiple(longest, longest + new), decode=runner.decode,
                              device=runner.device, call_tokens=runner.prefill_call_tokens)
            return iter([beam_search(session, sampler, new, stopper, repetition_penalty)])
        per_row = request.batch_inputs(inputs, runner.graph.runtime_inputs, len(rows))
        length, cache = runner.pool.take(len(rows), runner.cache_length(longest + new))
        engine = Engine(runner, len(rows), length, cache=cache, prefix_store=prefix_store,
                        multiple=runner.multiple(longest, longest + new))
        # row i draws from its own CPU generator seeded seed + i (samplers draw on the CPU, see
        # kvwire.generate.samplers): a seed gives the same tokens wherever the model runs, and a
        # row's tokens do not depend on the others of its batch
        seqs = [engine.submit(row, new, sampler=sampler, seed=None if seed is None else seed + i,
                              stop_ids=stop_ids, stop_strings=stop, inputs=per_row[i],
                              repetition_penalty=repetition_penalty, logprobs=logprobs,
                              reuse_prefix=prefix_store is not None, label=f"row {i}", constraint=constraint)
                for i, row in enumerate(rows)]
        return _returning(runner.pool, engine, _records(engine, seqs, stopper))


def _returning(pool, engine, run):
    """Yield from run, then give the engine's caches back for the next call."""
    yield from run
    pool.give(engine.capacity, engine.max_length, engine.cache)


def _records(engine, seqs, stopper):
    """Run the engine over a batch's sequences: a growing `Generation` after every step, then the
    finished one (stop strings cut, texts decoded). A row's error (non-finite logits) is raised."""
    gen = Generation([s.tokens for s in seqs], [s.logprobs for s in seqs])
    for _ in engine.run(seqs):
        failed = next((s.error for s in seqs if s.error is not None), None)
        if failed is not None:
            raise failed
        gen.prefill_seconds, gen.decode_seconds = engine.prefill_seconds, engine.decode_seconds
        gen.decode_steps = engine.decode_steps
        yield gen
    finish(gen, stopper)
    yield gen


def _last(iterator):
    item = None
    for item in iterator:
        pass
    return item


def visible_text(text, stops):
    """The part of partial output text that is safe to show: cut at a stop string; without a
    character still being assembled from byte tokens (U+FFFD) or a possible stop-string start."""
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    found = [text.find(s) for s in stops if s in text]
    if found:
        return text[:min(found)]
    text = text.rstrip("\ufffd")
    held = max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
    return text[:len(text) - held]
