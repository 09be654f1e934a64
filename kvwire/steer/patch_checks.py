"""What `kw.patch` checks in its arguments: the position map between the two prompts and the metric
(a caller's function, or the logit difference of two answer tokens)."""
import torch


def position_map_of(given, clean, corrupted):
    """{corrupted position: clean position}: identity for prompts of one length, else `given`."""
    if given is None:
        if clean != corrupted:
            raise ValueError(f"the clean prompt has {clean} tokens and the corrupted one {corrupted}: patching "
                             f"needs a position_map ({{corrupted position: clean position}}) for prompts of "
                             f"different token lengths")
        return {p: p for p in range(corrupted)}
    if isinstance(given, (list, tuple)):
        if len(given) != corrupted:
            raise ValueError(f"position_map as a list needs one entry per corrupted token ({corrupted}), got "
                             f"{len(given)}")
        given = {p: q for p, q in enumerate(given) if q is not None}
    if not isinstance(given, dict) or not given:
        raise ValueError(f"position_map must be a non-empty {{corrupted position: clean position}} dict or a "
                         f"list, got {given!r:.60}")
    out = {}
    for p, q in given.items():
        for value, n, side in ((p, corrupted, "corrupted"), (q, clean, "clean")):
            if isinstance(value, bool) or not isinstance(value, int) or not -n <= value < n:
                raise ValueError(f"position_map entry {p!r}: {q!r}: {side} positions must be ints in "
                                 f"[-{n}, {n}) (the {side} prompt has {n} tokens)")
        out[p % corrupted] = q % clean
    return out


def metric_of(lm, answers, metric):
    """logits (B, V) -> (B,): the caller's metric, or the logit difference of two answer tokens."""
    if (answers is None) == (metric is None):
        raise ValueError("give either answers=(correct, incorrect) (token ids or one-token texts) or metric= "
                         "(a function of the last position's logits (B, V) -> (B,)), not "
                         + ("both" if metric is not None else "neither"))
    if metric is not None:
        if not callable(metric):
            raise TypeError(f"metric must be a function of logits (B, V) -> (B,), got {type(metric).__name__}")

        def checked(logits):
            out = torch.as_tensor(metric(logits)).float()
            if out.shape != logits.shape[:1]:
                raise ValueError(f"metric returned shape {tuple(out.shape)}; expected ({logits.shape[0]},), "
                                 f"one score per row of the logits")
            return out

        return checked
    if not isinstance(answers, (list, tuple)) or len(answers) != 2:
        raise ValueError(f"answers must be (correct, incorrect), got {answers!r:.60}")
    correct, wrong = (_token(lm, a, side) for a, side in zip(answers, ("correct", "incorrect")))
    return lambda logits: logits[:, correct] - logits[:, wrong]


def _token(lm, answer, side):
    if isinstance(answer, str) and lm.tokenizer is not None:
        ids = lm.tokenizer.encode(answer, add_bos=False)
        if len(ids) != 1:
            raise ValueError(f"the {side} answer {answer!r} is {len(ids)} tokens ({ids}); expected one token")
        answer = ids[0]
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < lm.vocab_size:
        raise ValueError(f"the {side} answer must be a token id in [0, {lm.vocab_size}) or a one-token text, "
                         f"got {answer!r}")
    return answer
