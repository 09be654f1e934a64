"""One request in the engine: its prompt, options and what it has produced so far."""
import time

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class Sequence:
    """One request in the engine: its prompt, options and what it has produced so far.

    Read by callers: `tokens` (generated ids; stop tokens excluded), `logprobs` (each token's
    log-probability under the model, NaN when not asked for), `top_logprobs` (per token a list of
    (id, log-probability) when asked for), `done`, `finish_reason` ("stop", "length", "cancelled",
    "error"), `error` (the exception of a failed row), `cached_tokens` (prompt tokens reused from
    the prefix store), timings (`submitted`, `first_token_at`, `finished_at`, perf_counter seconds).
    `cancel()` may be called from any thread. A row ended by a stop string keeps the tokens that
    reach into it: callers cut the text (`Stopper.trim`), as `generate` does.
    """

    def __init__(self, prompt, max_new_tokens, sampler, generator, stopper, inputs, repetition_penalty,
                 logprobs, top_logprobs, listener, reuse_prefix, label):
        self.prompt, self.max_new_tokens, self.sampler, self.generator = prompt, max_new_tokens, sampler, generator
        self.stopper, self.inputs, self.repetition_penalty = stopper, inputs, repetition_penalty
        self.want_logprobs, self.want_top = logprobs, top_logprobs
        self.listener, self.reuse_prefix, self.label = listener, reuse_prefix, label
        self.tokens, self.logprobs, self.top_logprobs = [], [], []
        self.finish_reason, self.error, self.cached_tokens = None, None, 0
        self.submitted, self.first_token_at, self.finished_at = time.perf_counter(), None, None
        self.row, self.pending, self.seen, self.hit = None, None, None, None  # engine state
        self.steps = 0  # tokens sampled (the stop token included)
        self.matcher = None  # a constrained row's `RowMatcher` (kvwire.generate.constrain)
        self.inputs_key = ()  # the runtime inputs' values, for the prefix store
        self._cancel = False

    @property
    def done(self):
        return self.finish_reason is not None

    def cancel(self):
        """Stop this sequence at the engine's next step (a client went away); thread-safe."""
        self._cancel = True

    def __repr__(self):
        return (f"Sequence({self.label}, prompt={len(self.prompt)} tokens, generated={len(self.tokens)}, "
                f"finish_reason={self.finish_reason})")
