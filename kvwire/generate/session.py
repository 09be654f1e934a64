"""A batch being generated: left-padded prompts, their caches and the cached-graph calls."""
import torch

# Prompt tokens (all rows together) one prefill call runs at most. A call's activations and its
# attention masks (the flash kernel takes an additive one of groups*T x S floats for each window
# size) grow with the chunk: one call for a 4,096-token prompt raised the default model's peak RSS
# from 0.55 to 1.70 GB (2,048 tokens: 0.89 GB). 512 is llama.cpp's default micro-batch, and one
# 512-token call is the fastest for such a prompt (docs/kernels.md, Measurements). A model can ask for less
# (`CausalLM.prefill_call_tokens`): ggml-quantised ones do, where memory is what quantising was for.
PREFILL_CALL_TOKENS = 512


def prefill_step(batch, multiple=1, budget=None):
    """Prompt tokens per row in one prefill call of `batch` rows: `budget` (None: PREFILL_CALL_TOKENS)
    shared out, rounded down to a multiple of `multiple` (a program's chunk length), at least one of
    those (so past `budget` rows, or `multiple` x rows, a call runs more)."""
    budget = PREFILL_CALL_TOKENS if budget is None else budget
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"prefill_call_tokens must be an int >= 1 (or None: {PREFILL_CALL_TOKENS}), got {budget!r}")
    return max(multiple, budget // batch // multiple * multiple)


def left_pad(rows, pad_id=0, multiple=1, device="cpu"):
    """Token id rows of different lengths -> ids (B, L), positions (B, L), pad counts (B,) on
    `device`; L is the longest row rounded up to a multiple of `multiple`."""
    L = -(-max(len(r) for r in rows) // multiple) * multiple
    cpu = torch.device("cpu")  # filled row by row on the CPU, then moved in one copy each
    pads = torch.tensor([L - len(r) for r in rows], device=cpu)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long, device=cpu)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.as_tensor(r, dtype=torch.long, device=cpu)
    positions = (torch.arange(L, device=cpu)[None] - pads[:, None]).clamp(min=0)
    return ids.to(device), positions.to(device), pads.to(device)


def decode_step(cached, head, decode, tokens, positions, cache_index, mask, cache, inputs):
    """One token per row through the cached graph and the head: tokens (B,), positions (B, 1),
    cache_index () or (B,) -> (logits (B, V), next cache); through `decode` (a `CompiledDecode`)
    when given, with the same checks as the eager graph's."""
    if decode is None:
        hidden, cache = cached(tokens[:, None], positions, cache_index, mask, cache, **inputs)
        return head(hidden[:, -1]), cache
    return _compiled(cached, decode, tokens[:, None], positions, cache_index, mask, cache, inputs)


def prefill_chunk(cached, head, decode, ids, positions, start, mask, cache, inputs, last=True):
    """A chunk of prompt tokens per row through the cached graph: ids, positions (B, T), start (int,
    the chunk's first slot) -> (logits (B, V) after the chunk, or None when not `last`; next cache).
    A last chunk that `decode` (a `CompiledDecode`, or None) takes runs compiled."""
    if decode is not None and last and decode.takes(ids.shape[1], mask.shape[1]):
        return _compiled(cached, decode, ids, positions, torch.tensor(start, device=ids.device), mask, cache, inputs)
    hidden, cache = cached(ids, positions, start, mask, cache, **inputs)
    return (head(hidden[:, -1]) if last else None), cache


def _compiled(cached, decode, ids, positions, cache_index, mask, cache, inputs):
    """`decode`'s (logits, cache), after the checks the eager graph makes."""
    cached.check_call(ids, positions, cache_index, mask, cache)
    return decode(ids, positions, cache_index, mask, cache, cached.runtime_values(ids.shape[0], inputs))


class Session:
    """Runs one batch through a `CachedGraph` and a head: `prefill()` then `step(tokens)`.

    Args:
        cached: the CachedGraph. head: hidden (B, D) -> logits (B, V).
        rows: prompt token-id lists. max_length: cache timeline length (>= prompt + new tokens).
        cache: caches to reuse, allocated by `init_cache(len(rows), max_length)`, or None.
        inputs: values for the graph's runtime inputs ({name: (B,) tensor}); the rest take the
            layers' defaults for these prompts.
        multiple: pad the prompts to a multiple of this length (a program with static chunk
            lengths then runs the prompt in whole chunks; padding is masked out).
        decode: a `CompiledDecode` that runs the one-token steps instead of the eager graph, or None.
        device: where the model's weights are; ids, positions, masks and given runtime inputs are
            put there (the caches are made there by `init_cache`).
        call_tokens: prompt tokens (all rows) a prefill call runs at most (None: PREFILL_CALL_TOKENS).
    """

    def __init__(self, cached, head, rows, max_length, cache=None, inputs=None, multiple=1, decode=None,
                 device="cpu", call_tokens=None):
        self.cached, self.head, self.decode = cached, head, decode
        self.device = device = torch.device(device)
        self.ids, self.positions, self.pads = left_pad(rows, multiple=multiple, device=device)
        lengths = torch.tensor([len(r) for r in rows], device=device)
        given = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (inputs or {}).items()}
        self.inputs = {**cached.default_inputs(len(rows), lengths), **given}
        self.cache = cache if cache is not None else cached.init_cache(len(rows), max_length)
        self.max_length = max_length
        self.mask = torch.arange(max_length, device=device)[None] >= self.pads[:, None]  # left pads invalid
        self.index = 0
        self.chunk = prefill_step(len(rows), multiple, call_tokens)

    @property
    def prompt_length(self):
        return self.ids.shape[1]

    def prefill(self):
        """Logits of every row's next token after its prompt: (B, V). Long prompts run in chunks
        (`prefill_step`)."""
        end = self.ids.shape[1]
        if end == 0:
            raise ValueError("every prompt of the batch is empty: there is nothing to prefill (start prompts "
                             "with at least one token, e.g. BOS)")
        for at in range(0, end, self.chunk):
            stop = min(end, at + self.chunk)
            logits = self._run(self.ids[:, at:stop], self.positions[:, at:stop], last=stop == end)
        return logits

    def step(self, tokens):
        """Feed one token per row (B,); logits of the next: (B, V)."""
        positions = (self.index - self.pads)[:, None]
        index = torch.tensor(self.index, device=self.device)
        logits, self.cache = decode_step(self.cached, self.head, self.decode, tokens, positions, index, self.mask,
                                         self.cache, self.inputs)
        self.index += 1
        return logits

    def expand(self, n):
        """Repeat every row n times (rows i*n .. i*n+n-1 copy row i), caches included."""
        self.cache = tuple(tuple(t.repeat_interleave(n, 0) for t in pair) for pair in self.cache)
        self.mask, self.pads = self.mask.repeat_interleave(n, 0), self.pads.repeat_interleave(n, 0)
        self.inputs = {k: v.repeat_interleave(n, 0) for k, v in self.inputs.items()}

    def reorder(self, index):
        """Reorder rows (beam search) in place: row i takes the state of row index[i]."""
        for pair in self.cache:
            for t in pair:
                t.copy_(t.index_select(0, index))
        self.mask, self.pads = self.mask[index], self.pads[index]
        self.inputs = {k: v[index] for k, v in self.inputs.items()}

    def _run(self, ids, positions, last=True):
        logits, self.cache = prefill_chunk(self.cached, self.head, self.decode, ids, positions, self.index,
                                           self.mask, self.cache, self.inputs, last)
        self.index += ids.shape[1]
        return logits
