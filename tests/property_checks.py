"""Checks of the property tests: cached outputs against the uncached forward of the same model."""
import torch

# Cached and uncached forwards differ only in float32 summation order: attention over [cache, chunk]
# blocks (merged by log-sum-exp on the flash path) against one block, W @ x^T against x @ W^T. On
# logits up to ~36 (float32 eps 1.2e-7, relative) the largest difference seen in 1,500 cases of
# the chunked test was 1.1e-5; 1e-4 absolute (on logits and log-probabilities) leaves ~10x headroom
# and still catches a wrong key, position, mask or ring slot (>= 1e-2 in every seeded bug tried).
ATOL = 1e-4


@torch.no_grad()
def uncached_logprobs(lm, row):
    """log_softmax of the uncached logits of one row (T, V)."""
    return torch.log_softmax(lm(torch.tensor([row])), -1)[0]


def check_greedy(lm, prompt, tokens, logprobs, limit, stops=(), penalty=None, on_logprobs=False):
    """Cached greedy output `tokens` (with the chosen `logprobs`) against the uncached argmax rollout
    of `prompt`: equal token by token until the rollout picks a stop id (`stops`: not returned) or
    reaches `limit` tokens; with a repetition `penalty`, the argmax of the penalised logits
    (transformers' rule, over the prompt and the tokens so far), applied to the log-probabilities
    instead with `on_logprobs` (what beam search ranks, as transformers' processors). Up to the first difference the
    rollout is prompt + tokens, so one uncached forward of that gives every step. A float32
    near-tie (the chosen token within ATOL of the uncached best) may flip a pick; the rest is then
    not comparable, so the check stops there."""
    seq = list(prompt) + list(tokens)
    with torch.no_grad():
        logits = lm(torch.tensor([seq]))[0, len(prompt) - 1:]  # (len(tokens) + 1, V)
    logp = torch.log_softmax(logits, -1)
    for k, token in enumerate(list(tokens) + [None]):
        scores = logp[k] if on_logprobs else logits[k]
        if penalty is not None:
            seen = torch.zeros_like(scores, dtype=torch.bool)
            seen[seq[:len(prompt) + k]] = True
            scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
        best = int(scores.argmax())
        if token is None:  # the output ended: at a stop id or at the limit
            stop_gap = float(scores[best] - scores[list(stops)].max()) if stops else float("inf")
            assert k == limit or stop_gap <= ATOL, \
                f"output stopped after {k} tokens; the rollout continues with {best} (limit {limit}, stops {stops})"
            return
        assert token not in stops, f"token {k}: stop id {token} was returned"
        gap = float(scores[best] - scores[token])
        if token != best:
            assert gap <= ATOL, f"token {k}: cached {token}, uncached argmax {best} (score gap {gap:.3g})"
            return
        assert abs(logprobs[k] - float(logp[k, token])) <= ATOL, \
            f"token {k}: log-prob {logprobs[k]} != uncached {float(logp[k, token])}"


def check_logprobs(lm, prompt, tokens, logprobs):
    """Each returned log-probability equals the uncached one of that token after its prefix;
    returns the uncached sum over `tokens`."""
    if not tokens:
        return 0.0
    logp = uncached_logprobs(lm, list(prompt) + list(tokens)[:-1])[len(prompt) - 1:]
    want = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]  # (len(tokens),)
    torch.testing.assert_close(torch.tensor(logprobs), want, atol=ATOL, rtol=0)
    return float(want.sum())


def sequence_logprob(lm, prompt, tokens):
    """Uncached sum of the log-probabilities of `tokens` after `prompt`."""
    logp = uncached_logprobs(lm, list(prompt) + list(tokens)[:-1])[len(prompt) - 1:]
    return float(logp.gather(1, torch.tensor(tokens)[:, None]).sum()) if tokens else 0.0
