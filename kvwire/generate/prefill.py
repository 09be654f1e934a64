"""A prompt's prefill in the engine, run chunk by chunk into the engine's rows or a scratch cache."""
import torch

from .session import left_pad, prefill_chunk, prefill_step


class Prefill:
    """The prefill of a group of waiting sequences, run chunk by chunk.

    Direct: left-padded together into their contiguous rows of the engine's cache. Otherwise into a
    scratch cache of the group's length, copied into the rows when done; prefix hits (`prefix`: an
    (entry, reused) per row, or None) first restore their stored keys/values there, each row's
    reused positions ending in one column (`Engine._hits`), where the chunks start. Either way in chunks of `prefill_step` tokens a row (512 prompt
    tokens a call in all, or the model's `prefill_call_tokens`), scratch ones also at most `prefill_chunk`.
    """

    def __init__(self, engine, seqs, rows, direct, prefix):
        self.engine, self.seqs, self.rows, self.direct = engine, seqs, rows, direct
        device = engine.device
        prompts = [s.prompt for s in seqs]
        self.ids, self.positions, pads = left_pad(prompts, multiple=engine.multiple, device=device)
        self.pads = pads.tolist()
        length = self.ids.shape[1]
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        defaults = engine.cached.default_inputs(len(seqs), lengths)
        self.inputs = {name: value.clone() for name, value in defaults.items()}
        for i, seq in enumerate(seqs):
            for name, value in seq.inputs.items():
                self.inputs[name][i] = value
        if direct:
            r0 = rows[0]
            self.cache = tuple((k[r0:r0 + len(seqs)], v[r0:r0 + len(seqs)]) for k, v in engine._main_cache())
            self.mask = engine.mask[r0:r0 + len(seqs)]
            self.mask.copy_(torch.arange(engine.length, device=device)[None] >= pads[:, None])
        else:
            self.cache = engine.cached.init_cache(len(seqs), length)
            self.mask = torch.arange(length, device=device)[None] >= pads[:, None]
        self.at = 0
        for i, (entry, reused) in enumerate(prefix or ()):
            engine.prefix_store.restore(entry, reused, self.cache, i, self.pads[i])
            seqs[i].cached_tokens, at = reused, self.pads[i] + reused
            assert self.at in (0, at), "a batch of prefix hits must reuse up to one column"
            self.at = at

    def write_back(self):
        """Put a functional graph's new caches (an exported runtime returns new tensors) into the
        engine's rows; eager graphs wrote into them in place."""
        main, r0, n = self.engine._main_cache(), self.rows[0], len(self.seqs)
        if not main or self.cache[0][0].data_ptr() == main[0][0][r0:r0 + n].data_ptr():
            return  # no cached layers (all replaced by edits), or written in place
        if n == self.engine.capacity:
            self.engine.cache = self.cache
            return
        for (k, v), (nk, nv) in zip(main, self.cache):
            k[r0:r0 + n].copy_(nk)
            v[r0:r0 + n].copy_(nv)

    def row_inputs(self, i):
        return {name: value[i] for name, value in self.inputs.items()}

    def next_chunk_tokens(self):
        """Prompt tokens (all rows) that the next `advance` runs."""
        return (self._stop() - self.at) * self.ids.shape[0]

    def _stop(self):
        engine = self.engine
        step = prefill_step(len(self.seqs), engine.multiple, engine.runner.prefill_call_tokens)
        if not self.direct:  # a scratch prefill shares steps with decoding rows: prefill_chunk a row at most
            step = min(step, engine.prefill_chunk)
        return min(self.ids.shape[1], self.at + step)

    def advance(self):
        """Run the next chunk; the logits (B, V) after the prompts once the last one ran, else None."""
        engine, end, stop = self.engine, self.ids.shape[1], self._stop()
        # compiled only into the engine's rows (a scratch cache would compile a graph for its own
        # length): all of them, as `_decode` does, or with steps kept on disk (built once per shape,
        # ever) a power-of-two group of them, as the batch sizes those decode steps run
        n = len(self.seqs)
        rows_compile = n == engine.capacity or (engine.kept and n & (n - 1) == 0)
        decode = engine.decode if self.direct and rows_compile else None
        logits, self.cache = prefill_chunk(engine.cached, engine.head, decode, self.ids[:, self.at:stop],
                                           self.positions[:, self.at:stop], self.at, self.mask, self.cache,
                                           self.inputs, last=stop == end)
        self.at = stop
        return logits
