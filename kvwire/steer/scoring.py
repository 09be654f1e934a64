"""What `evaluate` reads off a steered model's rows: answer log-probabilities (the A/B logit
difference) and, on neutral text, KL divergence from the unsteered model and perplexity."""
from dataclasses import dataclass

import torch


@dataclass
class Answers:
    """A dataset tokenised for scoring.

    texts: the distinct token-id rows to run (prompt + answer but its last token; the two answers of
    an example share one row when they differ only in their last token, as " (A" and " (B" do);
    prompts: each text's prompt length (its answer tokens follow: what a "generated" schedule steers).
    Per scored token (M of them): `text` (M,) its row, `position` (M,) where it is predicted
    (unpadded), `token` (M,), `example` (M,) and `sign` (M,) float (+1 positive, -1 negative answer).
    """

    texts: list
    prompts: list
    text: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    example: torch.Tensor
    sign: torch.Tensor


def answers(lm, data):
    """`Answers` of `data` (an ABDataset), its tensors on the model's device; an answer that encodes
    to no tokens is refused by line."""
    texts, prompts, index, cols = [], [], {}, ([], [], [], [], [])
    for n, ex in enumerate(data):
        prompt = lm.encode(ex.prompt)
        for sign, kind, answer in ((1.0, "positive", ex.positive), (-1.0, "negative", ex.negative)):
            tokens = lm.tokenizer.encode(answer, add_bos=False)
            if not tokens:
                raise ValueError(f"{ex.where}: the {kind} answer {answer!r} encodes to no tokens; expected at "
                                 f"least one")
            row = tuple(prompt + tokens[:-1])
            lm.check_length(len(row) + 1, f"{ex.where}'s prompt and answer")
            t = index.setdefault((row, len(prompt)), len(texts))  # the same tokens with another prompt: steered apart
            if t == len(texts):
                texts.append(list(row))
                prompts.append(len(prompt))
            for j, token in enumerate(tokens):
                for col, value in zip(cols, (t, len(prompt) - 1 + j, token, n, sign)):
                    col.append(value)
    t, p, tok, ex, sign = (torch.tensor(c, device=lm.device) for c in cols)
    return Answers(texts, prompts, t, p, tok, ex, sign.float())


def answer_logprobs(head, hidden, rows, ans, lengths):
    """Sum over answer tokens of sign * log p(token), per (row, example).

    hidden: (R, T, D) final states of rows whose texts are `rows` (R,) (left-padded to T; `lengths`
    (n_texts,) unpadded lengths). Returns (scores (K,), row index (K,), example (K,)) for the K
    scored tokens of these rows."""
    T = hidden.shape[1]
    hit = rows[:, None] == ans.text[None]  # (R, M): which scored tokens each row carries
    r, m = hit.nonzero(as_tuple=True)
    where = T - lengths[ans.text[m]] + ans.position[m]  # the padded position predicting the token
    logits = head(hidden[r, where][None])[0].float()  # (K, V): only the positions read
    logp = torch.log_softmax(logits, -1).gather(1, ans.token[m, None])[:, 0]
    return logp * ans.sign[m], r, ans.example[m]


def windows(lm, text, size):
    """Neutral text (a str or a list of str) as token-id rows of at most `size` tokens (each str on
    its own; a row needs 2 tokens to score one)."""
    texts = [text] if isinstance(text, str) else list(text)
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"neutral text must be a non-empty str or a list of them, got {text!r:.60}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(f"neutral_tokens must be an int >= 2 (tokens per row), got {size!r}")
    rows = []
    for t in texts:
        ids = lm.encode(t)
        rows += [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) >= 2]
    if not rows:
        raise ValueError(f"neutral text {text!r:.60} encodes to fewer than 2 tokens; nothing to score")
    return rows


def next_logprobs(head, hidden, length):
    """log p over the vocabulary (length - 1, V) float32 at the positions of one left-padded row
    (hidden (T, D)) that predict a next token of its text."""
    return torch.log_softmax(head(hidden[None, hidden.shape[0] - length:-1])[0].float(), -1)


def side_effects(logp, base, tokens):
    """(KL summed over positions, NLL summed) of one row: logp, base (n, V) steered and unsteered
    log-probabilities, tokens (n,) the text's next tokens. KL(unsteered || steered) per position."""
    kl = (base.exp() * (base - logp)).sum(-1).sum()
    return float(kl), float(-logp.gather(1, tokens[:, None])[:, 0].sum())
