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

HEAD_ROWS = 512  # hidden states per head call: bounds the (rows, vocab) logits a long continuation makes


def continuation_logprobs(lm, requests, batch_size=16, progress=False):
    """log p(continuation | context) per token, and whether greedy decoding would produce it.

    Args:
        lm: a `CausalLM` (steered or edited alike).
        requests: [(context ids, continuation ids), ...], both non-empty lists of ints; requests
            with equal contexts share one run of it.
        batch_size: continuations per batch (their contexts run once each within it).
        progress: show a progress bar over batches.

    Returns:
        [(logprobs (n,) float32 tensor, greedy bool), ...] in the order of `requests`: entry t of
        logprobs is log p(continuation[t] | context + continuation[:t]), as `lm.score` of the joined
        ids gives it.

    Example:
        >>> ctx, cont = lm.encode("The capital of France is"), lm.tokenizer.encode(" Paris", add_bos=False)
        >>> (logprobs, greedy), = continuation_logprobs(lm, [(ctx, cont)])
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    groups = {}  # context -> indices of its requests, in request order
    for i, (context, continuation) in enumerate(requests):
        if len(context) == 0 or len(continuation) == 0:
            raise ValueError(f"request {i} has {len(context)} context and {len(continuation)} continuation tokens; "
                             f"both need at least one")
        lm.check_length(len(context) + len(continuation) - 1, f"request {i} (context + continuation)")
        groups.setdefault(tuple(context), []).append(i)
    longest_first = sorted(groups.items(), key=lambda g: -(len(g[0]) + max(len(requests[i][1]) for i in g[1])))
    out = [None] * len(requests)
    batches, runner = list(_batches(longest_first, batch_size)), lm.runner()
    with torch.inference_mode():
        for batch in tqdm(batches, desc="scoring continuations", disable=not progress, leave=False):
            conts = [[requests[i][1] for i in members] for _, members in batch]
            results = _score_batch(runner, [list(c) for c, _ in batch], conts)
            for (_, members), scored in zip(batch, results):
                for i, result in zip(members, scored):
                    out[i] = result
    return out


def _batches(groups, batch_size):
    """Groups of (context, request indices) packed into batches of at most `batch_size` continuations
    (a group larger than that forms a batch of its own)."""
    batch, rows = [], 0
    for group in groups:
        if batch and rows + len(group[1]) > batch_size:
            yield batch
            batch, rows = [], 0
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
