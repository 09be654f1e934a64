"""Continuation log-probabilities in batches through the cached graph, each context run once.

A multiple-choice question asks for log p(choice | context) for every choice: the rows share their
context. Contexts are left-padded together and run into a cache (once per distinct context); the
cache rows are then repeated for each continuation and the continuations run after them, right-padded
(a pad comes after every real token of its row, so causal attention never reads it). Only the hidden
states under continuation tokens reach the head.
"""
import torch
from tqdm import tqdm

from ..generate.session import left_pad, prefill_step
from ..serve.memory import available_bytes, cache_bytes

HEAD_ROWS = 512  # hidden states per head call: bounds the (rows, vocab) logits a long continuation makes
AUTO_SHARE = 0.25  # of the memory available, what an automatic batch's rows may take
FALLBACK_ROWS = 16  # an automatic batch where the memory available cannot be read


def auto_budget():
    """Bytes automatic batches may take: AUTO_SHARE of what this process may still allocate
    (`available_bytes`), or None where that cannot be read."""
    free, _ = available_bytes()
    return None if free is None else int(free * AUTO_SHARE)


def auto_rows(lm, length, max_rows=64, budget=None):
    """Rows of `length` positions a batch takes under `batch_size="auto"`: as many as fit `budget`
    bytes (default `auto_budget()`), at least 1, at most `max_rows` (FALLBACK_ROWS at most where
    the memory available cannot be read). A row costs its keys and values twice (a context's cache
    is copied to each of its continuations) plus its float32 hidden states.

    Example:
        >>> auto_rows(lm, 512, max_rows=64)
        64
    """
    budget = auto_budget() if budget is None else budget
    if budget is None:
        return min(FALLBACK_ROWS, max_rows)
    graph = lm.runner().graph
    row = 2 * cache_bytes(graph, 1, length) + length * lm.head.weight.shape[1] * 4
    return max(1, min(max_rows, budget // max(row, 1)))


def continuation_logprobs(lm, requests, batch_size=16, progress=False, max_batch_size=64):
    """log p(continuation | context) per token, and whether greedy decoding would produce it.

    Args:
        lm: a `CausalLM` (steered or edited alike).
        requests: [(context ids, continuation ids), ...], both non-empty lists of ints; requests
            with equal contexts share one run of it.
        batch_size: continuations per batch (their contexts run once each within it), or "auto":
            each batch as many as fit in memory (`auto_rows` of its longest request), at most
            `max_batch_size`.
        progress: show a progress bar over batches.

    Returns:
        [(logprobs (n,) float32 tensor, greedy bool), ...] in the order of `requests`: entry t of
        logprobs is log p(continuation[t] | context + continuation[:t]), as `lm.score` of the joined
        ids gives it.

    Example:
        >>> ctx, cont = lm.encode("The capital of France is"), lm.tokenizer.encode(" Paris", add_bos=False)
        >>> (logprobs, greedy), = continuation_logprobs(lm, [(ctx, cont)])
    """
    if batch_size == "auto":
        budget = auto_budget()  # read once: the batches below are sized against the same memory

        def fits(length):
            return auto_rows(lm, length, max_batch_size, budget)
    elif not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1 or 'auto', got {batch_size!r}")
    else:
        def fits(length):
            return batch_size
    groups = {}  # context -> indices of its requests, in request order
    for i, (context, continuation) in enumerate(requests):
        if len(context) == 0 or len(continuation) == 0:
            raise ValueError(f"request {i} has {len(context)} context and {len(continuation)} continuation tokens; "
                             f"both need at least one")
        lm.check_length(len(context) + len(continuation) - 1, f"request {i} (context + continuation)")
        groups.setdefault(tuple(context), []).append(i)
    longest_first = sorted(groups.items(), key=lambda g: -(len(g[0]) + max(len(requests[i][1]) for i in g[1])))
    out = [None] * len(requests)
    longest = [len(g[0]) + max(len(requests[i][1]) for i in g[1]) - 1 for g in longest_first]
    batches, runner = list(_batches(longest_first, [fits(n) for n in longest])), lm.runner()
    with torch.inference_mode():
        for batch in tqdm(batches, desc="scoring continuations", disable=not progress, leave=False):
            conts = [[requests[i][1] for i in members] for _, members in batch]
            results = _score_batch(runner, [list(c) for c, _ in batch], conts)
            for (_, members), scored in zip(batch, results):
                for i, result in zip(members, scored):
                    out[i] = result
    return out


def _batches(groups, sizes):
    """Groups of (context, request indices), longest first, packed into batches of at most
    sizes[k] continuations, k the batch's first (longest) group (a group larger than that forms a
    batch of its own)."""
    batch, rows, size = [], 0, None
    for group, fit in zip(groups, sizes):
        if batch and rows + len(group[1]) > size:
            yield batch
            batch, rows = [], 0
        if not batch:
            size = fit
        batch.append(group)
        rows += len(group[1])
    if batch:
        yield batch


def _score_batch(runner, contexts, conts):
    """contexts: G id lists; conts: for each, its continuations -> for each, [(logprobs, greedy)]."""
    graph, device = runner.graph, runner.device
    owner = torch.tensor([g for g, cs in enumerate(conts) for _ in cs], device=device)  # (R,) row -> context
    rows = [c for cs in conts for c in cs]
    tails = [c[:-1] for c in rows]  # fed after the context; the last token is only predicted
    width = max(len(t) for t in tails)
    ids, positions, pads = left_pad(contexts, device=device)
    start = ids.shape[1]
    length = start + width
    cache = graph.init_cache(len(contexts), length)
    mask = torch.arange(length, device=device)[None] >= pads[:, None]  # (G, S): left pads invalid
    last = _run(runner, ids, positions, 0, mask, cache, keep_all=False)  # (G, D) after each context
    hidden = [last[owner]]  # (R, D): predicts each continuation's first token
    if width:
        cache = tuple(tuple(t.index_select(0, owner) for t in pair) for pair in cache)
        tail_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        real = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        for r, t in enumerate(tails):
            tail_ids[r, :len(t)] = torch.as_tensor(t, dtype=torch.long, device=device)
            real[r, :len(t)] = True
        context_lengths = torch.tensor([len(contexts[g]) for g in owner.tolist()], device=device)
        tail_positions = torch.where(real, context_lengths[:, None] + torch.arange(width, device=device), 0)
        states = _run(runner, tail_ids, tail_positions, start, mask[owner], cache, keep_all=True)  # (R, W, D)
        hidden.append(states[real])  # row-major: row r's len(tails[r]) states in turn
    targets = torch.tensor([c[0] for c in rows] + [t for c in rows for t in c[1:]], device=device)
    logprobs, greedy = _head_logprobs(runner.head, torch.cat(hidden), targets)
    firsts, rest = logprobs[:len(rows)], logprobs[len(rows):]
    firsts_greedy, rest_greedy = greedy[:len(rows)], greedy[len(rows):]
    results, at = [], 0
    for r, c in enumerate(rows):
        n = len(c) - 1
        lp = torch.cat([firsts[r:r + 1], rest[at:at + n]]).cpu()
        ok = bool(firsts_greedy[r]) and bool(rest_greedy[at:at + n].all())
        results.append((lp, ok))
        at += n
    grouped, at = [], 0
    for cs in conts:
        grouped.append(results[at:at + len(cs)])
        at += len(cs)
    return grouped


def _run(runner, ids, positions, start, mask, cache, keep_all):
    """ids (B, T) through the cached graph from slot `start`, in calls of `prefill_step` tokens a
    row -> hidden (B, T, D) when `keep_all`, else the last position's (B, D)."""
    step = prefill_step(ids.shape[0], budget=runner.prefill_call_tokens)
    inputs = runner.graph.default_inputs(ids.shape[0])  # as the uncached forward (`lm.score`) takes them
    kept = []
    for at in range(0, ids.shape[1], step):
        hidden, cache = runner.graph(ids[:, at:at + step], positions[:, at:at + step], start + at, mask, cache,
                                     **inputs)
        kept.append(hidden if keep_all else hidden[:, -1])
    return torch.cat(kept, 1) if keep_all else kept[-1]


def _head_logprobs(head, hidden, targets):
    """hidden (N, D), targets (N,) -> (log p(target) (N,) float32, target is the argmax (N,) bool)."""
    logprobs, greedy = [], []
    for at in range(0, hidden.shape[0], HEAD_ROWS):
        logits = head(hidden[at:at + HEAD_ROWS]).float()
        t = targets[at:at + HEAD_ROWS, None]
        logprobs.append((logits.gather(1, t) - torch.logsumexp(logits, -1, keepdim=True))[:, 0])
        greedy.append(logits.argmax(-1) == t[:, 0])
    return torch.cat(logprobs), torch.cat(greedy)
