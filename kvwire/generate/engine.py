"""The engine: one decoding loop for every caller (`generate`, `stream`, `chat`, the server).

A scheduler of rows over one cached graph. Each row is a `Sequence` with its own sampler, seed,
stop rules, token budget and runtime inputs (steering strengths). Every `step()` runs one chunk
of a waiting prompt's prefill (if any) and one decode step of every decoding row; finished rows
free their slot, and waiting sequences take free slots between steps (continuous batching).

How rows that start at different times share one graph: the cached graph takes a per-row
`cache_index` (B,) (see `kvwire.graph.cache.CachedGraph`), so each row writes at its own place
in its own timeline. Prompts that arrive while others decode are prefilled (in chunks) into a
scratch cache of their own length and copied into their row when done, so a decode step never
touches a half-prefilled row; prompts that find the engine idle are prefilled straight into
their rows, left-padded together (what `generate` of a batch does), prefix hits too (their stored
keys/values restored into the rows first). Either way a prefill call
runs at most 512 prompt tokens, all rows together, or the model's `prefill_call_tokens`
(`session.prefill_step`). Graphs that take one write index for the batch (exported runtimes) run
in lockstep: a batch is admitted only when the engine is empty, and its rows step together until
the last finishes.

With `grow`, the rows' timeline starts at 256 positions and doubles (up to max_length) when a
sequence needs more, copying the keys/values into the longer one; when the engine empties it goes
back to 256. Memory then follows the work (a server of 8 rows x 4096 positions does not hold them
all from its first request), and decode steps, which attend over every slot, are shorter while
the sequences are. Powers of two keep the shapes few.

A free row inside the decode batch is fed a dummy token that writes into its own (free) row
only. Rows keep one shared index while they can (a batch admitted together), which keeps the
graph on the one-index path `torch.compile`d decode steps were built for.
"""
import itertools
import queue
import time
import warnings
from collections import Counter, deque

import torch

from ..io.heap import give_back_freed_memory
from ..kernels.threads import adaptive, pool
from .constrain import mask_logits
from .loop import Stopper, nonfinite_error
from .pick import choose, take_rows
from .prefix import copy_positions
from .request import RequestError, fits, positive_int, runtime_values, stop_token_ids, token_ids
from .request import repetition_penalty as check_penalty
from .request import sampler as check_sampler
from .request import seed as check_seed
from .request import stop_strings as check_stops
from .request import top_logprobs as check_top
from .prefill import Prefill
from .sequence import Sequence
from .session import decode_step

_numbers = itertools.count(1)
GROW_FROM = 256  # a growing engine's first timeline


class Engine:
    """Continuous batching over a `CausalLM`'s cached graph.

    Args:
        lm: the model (eager, compiled or exported), or the `Runner` it gives (`lm.runner()`).
            max_batch: rows decoding at once.
        max_length: each row's timeline (prompt + new tokens at most); default the model's context.
        prefill_chunk: prompt tokens per prefill call while other rows decode (bounds how long a
            long prompt stalls them).
        prefix_store: a `PrefixStore` to reuse prompts' keys/values from (and store finished
            sequences into), or None.
        cache: caches for (max_batch, max_length) to reuse, as `init_cache` makes them.
        grow: start the timeline short and double it as sequences need (see the module docstring);
            for graphs that take a write index per row, uncompiled or with kept compiled steps
            (`lm.compile()` on the CPU, which also decode over the occupied rows only: batch 1, 2, 4,
            ...), without `cache`. Else every row
            holds max_length positions from the first sequence on.
        decode_threads: torch's CPU threads for decode steps (prefill keeps the pool's size): a
            server leaves a core to its event loop, whose wake-ups stall a full team of OpenMP
            threads at every barrier of a decode step's many small ops. None: the pool as it is.
        adapt_threads: run each step on one thread fewer for every core other processes keep busy
            (`kvwire.kernels.threads.Threads`; never more than the pool's size at construction).
            None (default): adapt unless a command pinned the pool (`--threads`, `KVWIRE_THREADS`).

    Single-threaded use: `submit` sequences, then `run(seqs)` (yields after every step) or `step()`.
    From other threads (a server): `submit` and `Sequence.cancel` are thread-safe while one thread
    runs `serve_forever(stop)`; a `listener(seq)` given to `submit` is called from that thread
    after each new token and once when the sequence finishes.

    Example:
        >>> engine = Engine(lm, max_batch=4, max_length=256)
        >>> a = engine.submit(lm.tokenizer.encode("Once upon a time"), 20)
        >>> b = engine.submit(lm.tokenizer.encode("The capital of France is"), 8, sampler=kw.TopP(0.9), seed=1)
        >>> for _ in engine.run([a, b]): pass
        >>> lm.tokenizer.decode(a.tokens)
    """

    def __init__(self, lm, max_batch=8, max_length=None, *, prefill_chunk=256, prefix_store=None, cache=None,
                 multiple=1, grow=False, decode_threads=None, adapt_threads=None):
        runner = lm.runner() if hasattr(lm, "runner") else lm
        positive_int(max_batch, "max_batch")
        positive_int(prefill_chunk, "prefill_chunk")
        max_length = runner.max_context if max_length is None else max_length
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise RequestError(f"max_length must be an int >= 2, got {max_length!r}"
                               + (" (the model has no context length to default to)" if runner.max_context is None
                                  else ""), "max_length")
        # everything a step needs comes from the runner, read once: `submit` runs on callers'
        # threads (a server's event loop), where reading a Parameter while another thread traces
        # (torch.fx patches nn.Module.__getattr__ process-wide) gives a Proxy
        self.runner, self.cached, self.head, self.decode = runner, runner.graph, runner.head, runner.decode
        self.vocab_size, self.device, self.tokenizer = runner.vocab_size, runner.device, runner.tokenizer
        self.capacity, self.max_length, self.multiple = max_batch, max_length, multiple
        self.prefill_chunk, self.prefix_store = prefill_chunk, prefix_store
        if decode_threads is not None:
            positive_int(decode_threads, "decode_threads")
        self.decode_threads = decode_threads
        if adapt_threads not in (None, True, False):
            raise TypeError(f"adapt_threads={adapt_threads!r}; expected None, True or False")
        self.threads = adaptive() if adapt_threads is None else \
            (adaptive(force=True) if adapt_threads else None)  # kvwire.kernels.threads.Threads or None
        self.per_row = bool(getattr(self.cached, "row_index", False))
        self.cache = cache
        # compiled steps kept on disk (`AheadDecode.kept`) are built once per shape, ever: those may
        # grow the timeline and step over the occupied rows; torch.compile's would recompile each time
        self.kept = bool(getattr(self.decode, "kept", False))
        self.grow = bool(grow) and self.per_row and (self.decode is None or self.kept) and cache is None
        self.length = min(GROW_FROM, max_length) if self.grow else max_length  # the rows' timeline now
        self.rows = [None] * max_batch  # the Sequence in each row (or None)
        self.index, self.pads = [0] * max_batch, [0] * max_batch
        self.mask = torch.zeros(max_batch, self.length, dtype=torch.bool, device=self.device)
        self.inputs = None  # {name: (max_batch,) tensor}, made with the first row
        self.waiting, self.jobs = deque(), []
        self._inbox = queue.SimpleQueue()
        self.decode_steps, self.decode_seconds, self.prefill_seconds = 0, 0.0, 0.0
        self.mask_seconds = 0.0  # computing constrained rows' token masks (part of the steps' time)
        # what the scheduler did: prefills straight into rows / through a scratch cache, decode
        # steps whose rows were at different places of their timelines
        self.stats = Counter()

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt, max_new_tokens, *, sampler=None, seed=None, stop_ids=(), stop_strings=(),
               inputs=None, repetition_penalty=None, logprobs=True, top_logprobs=0, listener=None,
               reuse_prefix=True, label=None, prefix_key=None, constraint=None):
        """Queue a sequence; returns its `Sequence` (it runs at the engine's next steps).

        Args:
            prompt: token ids (list of int). max_new_tokens: budget (>= 1).
            sampler: a kvwire sampler (default kw.Greedy()); seed: this row's own random stream.
            stop_ids: ids that end the row (not returned); stop_strings: texts that end it (need the
                model's tokenizer; cut from the result at the end).
            inputs: runtime-input values for this row, {name: number} (e.g. {"happy_strength": 0.5});
                the others take the graph's defaults.
            logprobs: record each chosen token's log-probability (else NaN); top_logprobs: also
                the k most likely tokens at each step.
            listener: called as listener(seq) after each new token and when the row finishes.
            reuse_prefix: look the prompt up in (and store the result into) the prefix store.
            prefix_key: what else the row's keys/values depend on, hashable (e.g. a digest of the
                vectors a server lent it); part of its prefix-store key.
            constraint: a `kvwire.generate.constrain.Constraint` the output must match (JSON schema,
                regex, grammar): the row samples only tokens it allows and ends where it is complete.
                Compile it first (`constraint.compile(tokenizer, vocab_size)`) to keep that cost off
                the caller's thread here. Not with stop strings (the grammar decides the end).
        Raises `RequestError` (a ValueError) for a prompt + budget that does not fit max_length or
        the context, unknown inputs, or other bad values (see `kvwire.generate.request`).
        """
        prompt = token_ids(prompt, self.vocab_size)
        max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
        fits(len(prompt), max_new_tokens, self.runner.max_context, "the model's context")
        fits(len(prompt), max_new_tokens, self.max_length, "this engine's max_length")
        inputs = runtime_values(inputs, self.cached.runtime_inputs)
        seed = check_seed(seed)
        repetition_penalty = check_penalty(repetition_penalty)
        stop_strings = check_stops(stop_strings)
        if stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none", "stop")
        sampler, top_logprobs = check_sampler(sampler, beams=False), check_top(top_logprobs)
        stop_ids = stop_token_ids(stop_ids, self.vocab_size, "stop_ids")
        if constraint is not None and stop_strings:
            raise RequestError(f"stop strings {list(stop_strings)!r:.60} cannot be combined with a constraint "
                               f"({constraint.param}): the grammar decides where the output ends", "stop")
        matcher = None if constraint is None else constraint.matcher(self.tokenizer, self.vocab_size)
        generator = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        stopper = Stopper(stop_ids, stop_strings, self.tokenizer if stop_strings else None)
        seq = Sequence(prompt, max_new_tokens, sampler, generator, stopper,
                       dict(inputs or {}), repetition_penalty, logprobs, top_logprobs, listener, reuse_prefix,
                       label or f"request {next(_numbers)}")
        seq.matcher = matcher
        if self.prefix_store is not None and reuse_prefix:
            # keys/values depend on every runtime input's value, given or default ({} and a strength
            # of 0.0 compute the same thing and share entries)
            defaults = self.cached.default_inputs(1, torch.tensor([len(prompt)], device=self.device))
            values = {name: float(value[0]) for name, value in defaults.items()}
            values.update({name: float(value) for name, value in seq.inputs.items()})
            seq.inputs_key = tuple(sorted(values.items())) + ((("prefix_key", prefix_key),) if prefix_key else ())
        self._inbox.put(seq)
        return seq

    @property
    def idle(self):
        return not self.waiting and not self.jobs and all(r is None for r in self.rows) and self._inbox.empty()

    # -- driving ----------------------------------------------------------------------------------

    def run(self, seqs):
        """Step until every sequence of `seqs` is done, yielding after each step (callers that
        stream read the sequences' tokens between steps)."""
        while not all(s.done for s in seqs):
            self.step()
            yield

    def serve_forever(self, stop, poll=0.05, trim_every=60.0):
        """Step while there is work, until the threading.Event `stop` is set (a server's thread).

        A step that raises (a runtime failure, a bug) fails the sequences it was running, with that
        error, and the engine goes on with the waiting ones: one bad batch never stops a server.
        Every `trim_every` seconds the heap's freed pages go back to the OS (`io/heap.py`): requests
        of every size free key/value and activation tensors that glibc would otherwise keep."""
        next_trim = time.monotonic() + trim_every
        while not stop.is_set():
            if time.monotonic() >= next_trim:
                give_back_freed_memory()
                next_trim = time.monotonic() + trim_every
            if self.idle:
                try:
                    self.waiting.append(self._inbox.get(timeout=poll))  # wait for work without spinning
                except queue.Empty:
                    continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - reported to each request it ended
                self._fail_running(e)

    def _fail_running(self, error):
        running = [s for s in self.rows if s is not None] + [s for job in self.jobs for s in job.seqs]
        self.rows, self.jobs, self.cache = [None] * self.capacity, [], None  # caches made afresh
        for seq in running:
            if not seq.done:
                seq.error, seq.pending = error, None
                self._finish(seq, "error")

    @torch.inference_mode()
    def step(self):
        """One scheduling round: take new and cancelled sequences into account, admit waiting ones
        into free rows, run one prefill chunk, then one decode step of the decoding rows."""
        while not self._inbox.empty():
            self.waiting.append(self._inbox.get())
        self._drop_cancelled()
        self._admit()
        free = self.threads.for_step() if self.threads is not None and not self.idle else None
        try:
            with pool(free):
                self._step(free)
        finally:
            if free is not None:
                self.threads.stepped()

    def _step(self, free):
        if self.jobs:
            # prefill chunks up to `prefill_chunk` prompt tokens a step, oldest job first: a burst of
            # short prompts (or of prefix hits with a few new tokens each) joins in one step, while
            # a long prompt still takes one chunk a step between decode steps
            start, budget = time.perf_counter(), self.prefill_chunk
            while self.jobs and budget > 0:
                job = self.jobs[0]
                budget -= job.next_chunk_tokens()
                self._advance(job)
            self.prefill_seconds += time.perf_counter() - start
        if any(s is not None and s.pending is not None for s in self.rows):
            start = time.perf_counter()
            with pool(_fewest(self.decode_threads, free)):
                self._decode()
            self.decode_seconds += time.perf_counter() - start
            self.decode_steps += 1
        if self.grow and self.length > GROW_FROM and not self.jobs and all(s is None for s in self.rows):
            self.cache, self.length = None, min(GROW_FROM, self.max_length)  # empty: back to the short timeline
            self.mask = torch.zeros(self.capacity, self.length, dtype=torch.bool, device=self.device)

    # -- admission and prefill --------------------------------------------------------------------

    def _drop_cancelled(self):
        for seq in [s for s in self.waiting if s._cancel]:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled")
        for job in list(self.jobs):
            if all(s._cancel for s in job.seqs):
                self.jobs.remove(job)
                for seq in job.seqs:
                    self._release(seq)
                    self._finish(seq, "cancelled")
        for seq in [s for s in self.rows if s is not None and s._cancel and not s.done]:
            self._release(seq)
            self._finish(seq, "cancelled")

    def _free_rows(self):
        taken = {r for job in self.jobs for r in job.rows}
        return [r for r in range(self.capacity) if self.rows[r] is None and r not in taken]

    def _admit(self):
        if not self.waiting:
            return
        busy = any(s is not None for s in self.rows) or self.jobs
        if not self.per_row:  # one write index for the batch: admit only into an empty engine
            if not busy:
                self._start_job(self._group(self.capacity), direct=True)
            return
        while self.waiting and self._free_rows():
            free = self._free_rows()
            if self._lookup(self.waiting[0])[0] is not None:
                hits = self._hits(len(free))
                if not self._fit(max(len(seq.prompt) + seq.max_new_tokens for seq, _ in hits)):
                    return
                for _ in hits:
                    self.waiting.popleft()
                # an idle engine restores hits straight into their rows (no scratch cache to copy back,
                # and kept compiled steps run their chunks) where the rows' rings hold what they reuse
                direct = not busy and not self.jobs and all(e.usable(c, self._slots(self.length)) for _, (e, c) in hits)
                self._start_job([seq for seq, _ in hits], direct=direct, prefix=[hit for _, hit in hits],
                                rows=free[:len(hits)])
            else:
                group = self._group(len(free))
                longest = max(len(s.prompt) for s in group)
                if not self._fit(-(-longest // self.multiple) * self.multiple + max(s.max_new_tokens for s in group)):
                    self.waiting.extendleft(reversed(group))
                    return
                direct = not busy and len(self.jobs) == 0
                self._start_job(group, direct=direct, rows=free[:len(group)])
            busy = True

    def _fit(self, end):
        """Make the timeline hold positions [0, end) (a growing engine doubles it, up to max_length,
        copying the rows' keys/values); False while a direct prefill holds views of the rows."""
        if end <= self.length:
            return True
        if any(job.direct for job in self.jobs):
            return False
        length = self.length
        while length < end:
            length *= 2
        length = min(length, self.max_length)
        if self.cache is not None:
            longer = self.cached.init_cache(self.capacity, length)
            for old, new in zip(self.cache, longer):
                for a, b in zip(old, new):  # each into the start of its longer copy (rings of a
                    b[tuple(slice(0, n) for n in a.shape)].copy_(a)  # window fit both and keep their size)
            self.cache = longer
        self.length = length
        pads = torch.tensor(self.pads, device=self.device)
        self.mask = torch.arange(length, device=self.device)[None] >= pads[:, None]
        self.stats["timeline_grown"] += 1
        return True

    def _group(self, room):
        """Waiting sequences (FIFO) that can be left-padded into one prefill: up to `room`, each
        fitting its budget after the group's longest prompt; prefix hits go alone."""
        group, longest = [], 0
        while self.waiting and len(group) < room:
            seq = self.waiting[0]
            length = max(longest, len(seq.prompt))
            padded = -(-length // self.multiple) * self.multiple
            if group and (any(padded + s.max_new_tokens > self.max_length for s in group + [seq])
                          or (self.per_row and self._lookup(seq)[0] is not None)):
                break
            group.append(self.waiting.popleft())
            longest = length
        return group

    def _hits(self, room):
        """The waiting prefix hits at the queue's head (FIFO, up to `room`) that prefill as one batch:
        [(seq, (entry, reused))]. Left-padded together, their new tokens end in one column, so each
        row reuses its stored prefix up to where the batch's longest new part starts (recomputing the
        rest of it); a row joins while its entry can be restored that far (a ring or a state slot
        only at the positions it stored) and the batch computes at most twice the new tokens its rows
        need. The first hit always goes, alone if no other joins."""
        first = self.waiting[0]
        group = [(first, self._lookup(first))]
        while len(group) < room and len(group) < len(self.waiting):
            seq = self.waiting[len(group)]
            if self._lookup(seq)[0] is None:
                break
            wider = group + [(seq, seq.hit)]
            new = max(len(s.prompt) - c for s, (_, c) in wider)  # the batch's columns of new tokens
            if len(wider) * new > 2 * sum(len(s.prompt) - c for s, (_, c) in wider):
                break
            slots = self._slots(max(len(s.prompt) for s, _ in wider))
            least = max(1, self.prefix_store.min_tokens)
            if not all(len(s.prompt) - new >= least and e.usable(len(s.prompt) - new, slots) for s, (e, _) in wider):
                break
            group = wider
        new = max(len(s.prompt) - c for s, (_, c) in group)
        return [(s, (e, len(s.prompt) - new)) for s, (e, _) in group]

    def _slots(self, length):
        """Each cached layer's slots in a scratch cache of `length` positions (rings: at most window - 1)."""
        return [slot.module.cache_spec(1, length, None)[0][2] for slot in self.cached.slots]

    def _lookup(self, seq):
        """(stored Prefix, positions to reuse) for a waiting sequence, or (None, 0); looked up once,
        and again if the entry found was evicted meanwhile (its pages may hold other keys now)."""
        if seq.hit is None or (seq.hit[0] is not None and not seq.hit[0].alive):
            store = self.prefix_store
            if store is None or not seq.reuse_prefix or not self.per_row:
                seq.hit = (None, 0)
            else:
                seq.hit = store.lookup(seq.prompt, seq.inputs_key, self._slots(len(seq.prompt)))
        return seq.hit

    def _start_job(self, seqs, direct, prefix=None, rows=None):
        rows = list(range(len(seqs))) if rows is None else rows
        if direct:
            rows = list(range(rows[0], rows[0] + len(seqs))) if _contiguous(rows) else None
            if rows is None:  # direct prefill writes into a contiguous block of rows
                direct, rows = False, self._free_rows()[:len(seqs)]
        job = Prefill(self, seqs, rows, direct, prefix)
        self.stats["direct_prefills" if direct else "scratch_prefills"] += 1
        for seq in seqs:
            seq.row, seq.hit = None, (None, 0)  # restored into the job: the entry may be evicted now
        self.jobs.append(job)

    def _advance(self, job):
        logits = job.advance()
        if logits is None:
            return
        self.jobs.remove(job)
        if job.direct:
            job.write_back()
        for i, (seq, row) in enumerate(zip(job.seqs, job.rows)):
            if seq._cancel:
                self._finish(seq, "cancelled")
                continue
            if not job.direct:
                copy_positions(job.cache, i, job.pads[i], self._main_cache(), row, 0, 0, len(seq.prompt))
            pad = job.pads[i] if job.direct else 0
            self._place(seq, row, pad, pad + len(seq.prompt), job.row_inputs(i))
        live = [(i, s) for i, s in enumerate(job.seqs) if s.row is not None]
        if live:
            self._sample(logits[[i for i, _ in live]], [s for _, s in live])

    def _main_cache(self):
        if self.cache is None:
            self.cache = self.cached.init_cache(self.capacity, self.length)
        return self.cache

    def _place(self, seq, row, pad, index, inputs):
        """Seat a prefilled sequence in `row`: its timeline starts at `pad`, continues at `index`."""
        self.rows[row], seq.row = seq, row
        self.pads[row], self.index[row] = pad, index
        self.mask[row] = torch.arange(self.length, device=self.device) >= pad
        if self.inputs is None:
            self.inputs = {name: torch.zeros((self.capacity,), dtype=dtype, device=self.device)
                           for name, dtype in self.cached.runtime_inputs.items()}
        for name, value in inputs.items():
            self.inputs[name][row] = value
        if seq.repetition_penalty is not None:
            seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seq.seen[torch.tensor(seq.prompt, device=self.device)] = True

    # -- decoding ---------------------------------------------------------------------------------

    def _decode(self):
        span = self.capacity
        if self.per_row and (self.decode is None or self.kept):
            span = 1 + max(r for r, s in enumerate(self.rows) if s is not None)
            if self.decode is not None:  # kept steps: batch 1, 2, 4, ... (a few shapes)
                span = min(self.capacity, 1 << (span - 1).bit_length())
        cache = self._main_cache()
        if span < self.capacity:
            cache = tuple((k[:span], v[:span]) for k, v in cache)
        rows = self.rows[:span]
        tokens = torch.tensor([s.pending if s is not None and s.pending is not None else 0 for s in rows],
                              device=self.device)
        index_list = self.index[:span]
        index = torch.tensor(index_list, device=self.device)
        positions = (index - torch.tensor(self.pads[:span], device=self.device))[:, None]
        if len(set(index_list)) == 1 or not self.per_row:
            index = index[0]  # rows in step: the one-index path (what compiled decode steps were built for)
        else:
            self.stats["per_row_steps"] += 1
        mask = self.mask[:span]
        inputs = {name: value[:span] for name, value in self.inputs.items()}
        logits, new_cache = decode_step(self.cached, self.head, self.decode, tokens, positions, index, mask, cache,
                                        inputs)
        if span == self.capacity:
            self.cache = new_cache
        elif cache and new_cache[0][0].data_ptr() != cache[0][0].data_ptr():  # a functional step: copy back
            for (k, v), (nk, nv) in zip(self.cache, new_cache):
                k[:span].copy_(nk)
                v[:span].copy_(nv)
        for r in range(span):
            self.index[r] = min(self.index[r] + 1, self.length - 1) if self.rows[r] is None or \
                self.rows[r].done else self.index[r] + 1
        live = [(r, s) for r, s in enumerate(rows) if s is not None and not s.done and s.pending is not None]
        for _, s in live:
            s.pending = None
        self._sample(take_rows(logits, [r for r, _ in live]), [s for _, s in live])

    def _sample(self, logits, seqs):
        """Choose each sequence's next token from its logits row (len(seqs), V)."""
        if not seqs:
            return
        finite = torch.isfinite(logits.sum(-1, dtype=torch.float32))
        if not bool(finite.all()):
            keep = []
            for i, seq in enumerate(seqs):
                if bool(finite[i]) or bool(torch.isfinite(logits[i]).all()):
                    keep.append(i)
                else:
                    seq.error = nonfinite_error(logits[i], seq.steps, seq.label)
                    self._release(seq, dirty=True)
                    self._finish(seq, "error")
            logits, seqs = logits[keep], [seqs[i] for i in keep]
            if not seqs:
                return
        logits, stuck, seconds = mask_logits(logits, seqs)
        self.mask_seconds += seconds
        if stuck:
            for i, why in stuck:
                seqs[i].error = RequestError(f"{seqs[i].label}: constrained decoding stopped after "
                                             f"{len(seqs[i].tokens)} tokens: {why}", "constraint")
                self._release(seqs[i])
                self._finish(seqs[i], "error")
            keep = [i for i in range(len(seqs)) if not seqs[i].done]
            logits, seqs = logits[keep], [seqs[i] for i in keep]
            if not seqs:
                return
        tokens, chosen_lp, tops = choose(logits, seqs)
        now = time.perf_counter()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.steps += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.stopper.token_stops(token):
                self._complete(seq, "stop", fed=len(seq.tokens))  # every appended token was fed
                continue
            seq.tokens.append(token)
            seq.logprobs.append(chosen_lp.get(i, float("nan")))
            if seq.want_top:
                seq.top_logprobs.append(tops[i])
            if seq.seen is not None:
                seq.seen[token] = True
            if seq.matcher is not None and self._constrained_end(seq, token):
                continue
            if seq.stopper.text_stops(seq.tokens):
                self._complete(seq, "stop", fed=len(seq.tokens) - 1)  # the last one was never fed
            elif len(seq.tokens) >= seq.max_new_tokens:
                self._complete(seq, "length", fed=len(seq.tokens) - 1)
            else:
                seq.pending = token
                if seq.listener is not None:
                    seq.listener(seq)

    def _constrained_end(self, seq, token):
        """Advance a constrained row's grammar by its new token; True when that ended the row (the
        grammar is complete and takes nothing more, or it refused the token)."""
        if not seq.matcher.take(token):
            seq.error = RequestError(f"{seq.label}: the grammar refused token {token} "
                                     f"({seq.matcher.error or 'no reason given'})", "constraint")
            self._release(seq)
            self._finish(seq, "error")
            return True
        if seq.matcher.finished:
            self._complete(seq, "stop", fed=len(seq.tokens) - 1)  # the last one was never fed
            return True
        return False

    # -- finishing --------------------------------------------------------------------------------

    def _complete(self, seq, reason, fed):
        """A row reached its end (`fed`: its generated tokens that went through the graph): store
        its keys/values for reuse, free its row, finish it."""
        store = self.prefix_store
        # not a cancelled one: its caller may have given back what its rows read (a server frees a
        # request's inline slots when its client leaves), so its keys/values need not be its key's
        if store is not None and seq.reuse_prefix and self.per_row and seq.row is not None and not seq._cancel:
            try:
                store.store(self.cache, seq.row, self.pads[seq.row], seq.prompt + seq.tokens[:fed], seq.inputs_key)
            except Exception as e:  # noqa: BLE001 - storing is an optimisation: the sequence is done
                # (out of memory is not an error here: the store skips that sequence itself)
                warnings.warn(f"the prefix store failed to store a sequence ({type(e).__name__}: {e}); it is "
                              f"disabled, so no prompt is restored from it", RuntimeWarning)
                store.disable(f"{type(e).__name__}: {e}")
        self._release(seq)
        self._finish(seq, reason)

    def _release(self, seq, dirty=False):
        """Free the sequence's row (a row that held non-finite values is zeroed first)."""
        for job in self.jobs:
            if seq in job.seqs:
                return  # still prefilling: the job drops it when it ends
        row = seq.row
        if row is None or self.rows[row] is not seq:
            return
        if dirty:
            for k, v in self.cache:
                k[row].zero_()
                v[row].zero_()
        if self.per_row:
            self.rows[row] = None
        seq.pending = None

    def _finish(self, seq, reason):
        if seq.done:
            return
        seq.finish_reason, seq.finished_at = reason, time.perf_counter()
        if not self.per_row and all(s is None or s.done or s is seq for s in self.rows):
            self.rows = [None] * self.capacity  # lockstep batch over: the rows are free again
        if seq.listener is not None:
            seq.listener(seq)


def _fewest(*counts):
    """The smallest of the thread counts given (None: no bound), or None."""
    given = [n for n in counts if n is not None]
    return min(given) if given else None


def _contiguous(rows):
    return rows == list(range(rows[0], rows[0] + len(rows)))


