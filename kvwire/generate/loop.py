"""What generation produces (`Generation`), stop rules, and beam search over a `Session`.

Sampling (greedy included) runs in the engine (kvwire.generate.engine), for every caller. Beam
search is the one other loop: its rows are not independent sequences (every step reorders them),
so it keeps a batch of its own."""
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Generation:
    """What a generation produced, per row: token ids (stop tokens and stop strings excluded),
    each token's log-probability under the model (raw logits, before temperature or filters),
    text when prompts were text, and timings."""

    tokens: list
    logprobs: list
    texts: list = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    finished: bool = field(default=False, repr=False)

    @property
    def decode_tokens_per_second(self):
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class Stopper:
    """When a row ends: on a stop token id (EOS; not returned) or once its text contains a stop
    string (the stop string and what follows are not returned)."""

    def __init__(self, stop_ids=(), stop_strings=(), tokenizer=None):
        self.stop_ids = set(stop_ids)
        self.stop_strings = tuple(stop_strings)
        self.tokenizer = tokenizer

    def token_stops(self, token):
        return token in self.stop_ids

    def text_stops(self, tokens):
        return bool(self.stop_strings) and self.cut(self.tokenizer.decode(tokens)) is not None

    def cut(self, text):
        """Index where the first stop string starts in text, or None."""
        found = [text.find(s) for s in self.stop_strings if s in text]
        return min(found) if found else None

    def trim(self, tokens, logprobs):
        """Drop the tokens that reach into a stop string; returns (tokens, logprobs, text or None)."""
        if self.tokenizer is None:
            return tokens, logprobs, None
        text = self.tokenizer.decode(tokens)
        at = self.cut(text) if self.stop_strings else None
        if at is None:
            return tokens, logprobs, text
        keep = len(tokens)
        while keep and len(self.tokenizer.decode(tokens[:keep])) > at:
            keep -= 1
        return tokens[:keep], logprobs[:keep], text[:at]


def check_finite(logits, step, live=None, beams=1):
    """Refuse non-finite logits (B, V) of the rows still generating (`live`: (B,) bools, or all) at
    a step (0: the logits after the prompt) instead of sampling tokens from them. With beams > 1,
    rows are prompt-major beams and the error names the prompt and the beam. `live` may be on the
    CPU while the logits are not (moved only when something is not finite)."""
    # a row's float32 sum is finite whenever its values are (~25 us a 262k row, against ~530 for
    # isfinite().all()); a huge but finite row that overflows the sum only takes the exact check
    if bool(torch.isfinite(logits.sum(-1, dtype=torch.float32)).all()):
        return
    bad = ~torch.isfinite(logits).all(-1)
    if live is not None:
        bad &= live.to(bad.device)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        where = f"row {row}" if beams == 1 else f"row {row // beams} (beam {row % beams})"
        raise nonfinite_error(logits[row], step, where)


def nonfinite_error(values, step, where):
    """The FloatingPointError for a row's non-finite logits `values` (V,) at a generation step."""
    kinds = [k for k, m in (("nan", values.isnan()), ("inf", values.isinf())) if bool(m.any())]
    after = "after the prompt" if step == 0 else f"after {step} generated token{'s' if step > 1 else ''}"
    return FloatingPointError(
        f"non-finite logits ({'/'.join(kinds)}) in {where} at generation step {step} ({after}): the "
        f"model's numbers overflowed (a steering strength too large, float16 weights, or broken "
        f"weights?); no tokens were sampled from them")


def _seen_tokens(session, vocab_size):
    """(B, V) bools: which tokens occur in each row's prompt (left padding excluded)."""
    device = session.ids.device
    seen = torch.zeros(session.ids.shape[0], vocab_size, dtype=torch.bool, device=device)
    real = torch.arange(session.prompt_length, device=device)[None] >= session.pads[:, None]
    rows, cols = real.nonzero(as_tuple=True)
    seen[rows, session.ids[rows, cols]] = True  # only real tokens are written (no pad writes to race)
    return seen


def penalize(logits, seen, penalty):
    """transformers' repetition penalty: seen tokens' logits divided (if > 0) or multiplied by it."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def finish(gen, stopper):
    """Cut stop strings from a finished record and decode its texts."""
    trimmed = [stopper.trim(t, lp) for t, lp in zip(gen.tokens, gen.logprobs)]
    gen.tokens, gen.logprobs = [t for t, _, _ in trimmed], [lp for _, lp, _ in trimmed]
    gen.texts = None if stopper.tokenizer is None else [text for _, _, text in trimmed]
    gen.finished = True


@torch.inference_mode()
def beam_search(session, beam, max_new_tokens, stopper, repetition_penalty=None):
    """Beam search (see `BeamSearch`); returns the best hypothesis per row as a `Generation`.

    repetition_penalty applies to the log-probabilities that rank the beams (as transformers'
    processors do); the recorded log-probabilities stay the model's own. The beams' bookkeeping is
    Python lists: each step copies its 2n candidates per row out of the device once."""
    B, n = session.ids.shape[0], beam.num_beams
    start = time.perf_counter()
    logits = session.prefill()
    check_finite(logits, 0)
    raw = torch.log_softmax(logits.float(), -1)
    device = raw.device
    prefill = time.perf_counter() - start
    V = raw.shape[-1]
    if n > V:
        raise ValueError(f"num_beams={n} exceeds the vocabulary of {V} tokens")
    seen = None if repetition_penalty is None else _seen_tokens(session, V).repeat_interleave(n, 0)
    session.expand(n)
    raw = raw.repeat_interleave(n, 0)
    logp = raw if seen is None else penalize(raw, seen, repetition_penalty)
    scores = [[0.0] + [float("-inf")] * (n - 1) for _ in range(B)]  # the n copies are identical: start from one
    seqs = [[[] for _ in range(n)] for _ in range(B)]
    lps = [[[] for _ in range(n)] for _ in range(B)]
    finished = [[] for _ in range(B)]  # (score, tokens, logprobs)
    done = [False] * B
    norm = lambda total, length: total / max(length, 1) ** beam.length_penalty  # noqa: E731
    start, steps = time.perf_counter(), 0
    for step in range(max_new_tokens):
        totals = torch.tensor(scores, dtype=torch.float32, device=device).view(-1, 1) + logp
        top, idx = totals.view(B, n * V).topk(min(2 * n, n * V), dim=-1)
        # raw[b * n + parent, token] of every candidate, parent * V + token being its index in row b
        token_lps = raw.view(B, n * V).gather(1, idx).tolist()
        top, idx = top.tolist(), idx.tolist()
        rows, tokens, new_scores = [], [], []
        new_seqs, new_lps = [], []
        for b in range(B):
            picked = []
            for rank in range(len(top[b])):
                if done[b] or len(picked) == n or top[b][rank] == float("-inf"):
                    break
                parent, token = divmod(idx[b][rank], V)
                if stopper.token_stops(token):
                    if rank < n:
                        finished[b].append((norm(top[b][rank], step + 1), seqs[b][parent], lps[b][parent]))
                    continue
                picked.append((parent, token, top[b][rank], token_lps[b][rank]))
            picked += [(0, 0, float("-inf"), 0.0)] * (n - len(picked))  # finished rows keep dummies
            for parent, token, _, _ in picked:
                rows.append(b * n + parent)
                tokens.append(token)
            new_scores.append([score for _, _, score, _ in picked])
            new_seqs.append([seqs[b][p] + [t] for p, t, _, _ in picked])
            new_lps.append([lps[b][p] + [lp] for p, _, _, lp in picked])
            if not done[b] and len(finished[b]) >= n:
                worst = min(f[0] for f in finished[b])
                # "never": the best score a running beam could still reach (scores only fall; a
                # positive length penalty rewards the longest length allowed)
                length = max_new_tokens if beam.early_stopping == "never" and beam.length_penalty > 0 else step + 1
                best_running = norm(max(new_scores[b]), length)
                done[b] = beam.early_stopping is True or best_running <= worst
        scores, seqs, lps = new_scores, new_seqs, new_lps
        if all(done) or step == max_new_tokens - 1:
            break
        order, chosen = torch.tensor(rows, device=device), torch.tensor(tokens, device=device)
        session.reorder(order)
        logits = session.step(chosen)
        live = torch.tensor([s > float("-inf") and not done[b] for b in range(B) for s in scores[b]], device="cpu")
        check_finite(logits, step + 1, live, beams=n)
        raw = torch.log_softmax(logits.float(), -1)
        if seen is not None:
            seen = seen[order].scatter_(1, chosen[:, None], True)
        logp = raw if seen is None else penalize(raw, seen, repetition_penalty)
        steps += 1
    for b in range(B):
        if not done[b]:
            finished[b] += [(norm(scores[b][j], len(seqs[b][j])), seqs[b][j], lps[b][j])
                            for j in range(n) if scores[b][j] > float("-inf")]
    best = [max(f, key=lambda h: h[0]) for f in finished]
    gen = Generation([list(h[1]) for h in best], [list(h[2]) for h in best], prefill_seconds=prefill,
                     decode_seconds=time.perf_counter() - start, decode_steps=steps)
    finish(gen, stopper)
    return gen
