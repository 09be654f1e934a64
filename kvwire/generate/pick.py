"""Choosing each row's next token from its logits: repetition penalties, each row's own sampler
and random stream, and the chosen tokens' log-probabilities (and top alternatives) when asked."""
import torch

from .loop import penalize


def choose(logits, seqs):
    """logits (len(seqs), V), finite -> (tokens [int], {i: chosen log-probability},
    {i: [(id, log-probability)] top alternatives}) for the rows that asked."""
    scores = logits
    penalized = [i for i, s in enumerate(seqs) if s.repetition_penalty is not None]
    if penalized:
        scores = logits.clone()
        for i in penalized:
            scores[i] = penalize(logits[i], seqs[i].seen, seqs[i].repetition_penalty)
    tokens = [0] * len(seqs)
    by_sampler = {}
    for i, s in enumerate(seqs):
        by_sampler.setdefault(s.sampler, []).append(i)
    for sampler, idx in by_sampler.items():
        chosen = sampler.sample_rows(take_rows(scores, idx), [seqs[i].generator for i in idx]).tolist()
        for i, t in zip(idx, chosen):
            tokens[i] = t
    want = [i for i, s in enumerate(seqs) if s.want_logprobs or s.want_top]
    chosen_lp, tops = {}, {}
    if want:
        logp = torch.log_softmax(take_rows(logits, want).float(), -1)
        picked = torch.tensor([tokens[i] for i in want], device=logp.device)[:, None]
        for j, (i, lp) in enumerate(zip(want, logp.gather(1, picked)[:, 0].tolist())):
            chosen_lp[i] = lp
            if seqs[i].want_top:
                top = logp[j].topk(min(seqs[i].want_top, logp.shape[-1]))
                tops[i] = list(zip(top.indices.tolist(), top.values.tolist()))
    return tokens, chosen_lp, tops


def take_rows(t, rows):
    """t[rows], without a copy when rows are all of t's rows in order (a decode step's usual case:
    the logits of every row, (B, V) over a vocabulary of up to 262k)."""
    return t if rows == list(range(t.shape[0])) else t[rows]
