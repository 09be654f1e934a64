"""`kw.steer.evaluate`: what a steering operation does across strengths, measured without a judge:
the A/B logit difference on a contrastive dataset, its steerability, and the side effects on
neutral text, every strength a row of the same batches (`kvwire.steer.rows`)."""
import json
import math
from dataclasses import asdict, dataclass

import torch

from .dataset import ABDataset, dataset as load_dataset, neutral_text
from .operation import Operation
from .rows import RowRunner
from .scoring import answer_logprobs, answers, next_logprobs, side_effects, windows
from .turns import turn


def json_text(data, path=None):
    """`data` as indented JSON text, written to `path` (with a final newline) too when one is given."""
    text = json.dumps(data, indent=1)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return text


@dataclass
class Evaluation:
    """`evaluate`'s result; lists are per strength (S) unless said otherwise.

    logit_diff: mean over examples of the A/B logit difference; per_example: (N, S) each example's.
    slopes: (N,) each example's steerability; slope_mean, slope_std: their mean and standard
    deviation; anti_steerable: the fraction of examples with slope < 0.
    kl: mean KL(unsteered || steered) per neutral token (nats); perplexity: the steered model's on
    the neutral text; base_perplexity: the unsteered model's; ppl_increase: perplexity /
    base_perplexity - 1; neutral_tokens: how many tokens those are over.
    """

    operation: str
    dataset: str
    strengths: list
    logit_diff: list
    per_example: list
    slopes: list
    slope_mean: float
    slope_std: float
    anti_steerable: float
    kl: list
    perplexity: list
    base_perplexity: float
    ppl_increase: list
    neutral_tokens: int

    def to_dict(self):
        return asdict(self)

    def to_json(self, path=None):
        """The result as JSON text; written to `path` too when one is given."""
        return json_text(self.to_dict(), path)

    def plot(self, path, title=None):
        """Logit difference against strength (the mean and each example) beside the side effects
        (KL and perplexity increase), drawn with matplotlib into `path` (.png, .svg, .pdf)."""
        from .evaluate_plot import plot_evaluation
        plot_evaluation(self, path, title)


def evaluate(lm, operation, dataset, strengths, *, neutral=None, neutral_tokens=128, batch_size=64):
    """Measure `operation` at each strength on an A/B dataset and on neutral text.

    The A/B logit difference of an example at strength s is
    sum_j log p_s(pos_j | prompt, pos_<j) - sum_j log p_s(neg_j | prompt, neg_<j), over the tokens
    pos_j, neg_j of its positive and negative answers (each encoded without BOS after the prompt's
    tokens), under the model steered at s. An example's steerability is the least-squares slope of
    that difference against s; an anti-steerable example has a negative slope (arXiv 2407.12404).
    Side effects on the neutral text, cut into rows of `neutral_tokens` tokens: KL(p_0 || p_s) =
    sum_v p_0(v) (log p_0(v) - log p_s(v)) at every position that predicts a next token of the
    text, averaged over them (p_0: the unsteered model), and the perplexity exp(mean NLL) there.

    The steered model is built once; each strength is a set of runtime inputs, so all strengths run
    as rows of the same batches, and the blocks below the first steered one run once per text.

    Args:
        lm: a CausalLM with a tokenizer.
        operation: a `kw.ControlVector` (added, ablated or clamped by its own operation) or a
            `kw.steer.Operation` (see it for what a strength means for each operation).
        dataset: an `ABDataset`, a shipped dataset's name ("sentiment-ab"), a JSONL path or records.
        strengths: at least two distinct finite numbers, kept in the given order.
        neutral: the side effects' text (a str or a list of str); None: the package's neutral prose.
        neutral_tokens: tokens per neutral row.
        batch_size: rows per forward call.
    Returns an `Evaluation`.

    Example:
        >>> result = kw.steer.evaluate(lm, vec, "sentiment-ab", [-4, -2, 0, 2, 4])
        >>> result.logit_diff, result.slope_mean, result.kl
        >>> result.plot("eval.png"); result.to_json("eval.json")
    """
    reference = Reference(lm, dataset, neutral, neutral_tokens, batch_size)
    return reference.measure(Operation.of(operation), strengths)


class Reference:
    """What every evaluation of one model on one dataset shares: the tokenised answers, the neutral
    rows and the unsteered model's log-probabilities on them (`calibrate` measures many operations
    against one)."""

    def __init__(self, lm, dataset, neutral=None, neutral_tokens=128, batch_size=64):
        if lm.tokenizer is None:
            raise ValueError("evaluate needs a model with a tokenizer (prompts and answers are text)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1 (rows per call), got {batch_size!r}")
        self.lm, self.batch_size = lm, batch_size
        self.data = dataset if isinstance(dataset, ABDataset) else \
            load_dataset(dataset) if isinstance(dataset, str) or hasattr(dataset, "__fspath__") else \
            ABDataset.from_records(dataset)
        self.answers = answers(lm, self.data)
        self.windows = windows(lm, neutral_text() if neutral is None else neutral, neutral_tokens)
        self.next = [torch.tensor(w[1:], device=lm.device) for w in self.windows]
        with torch.inference_mode():
            runner = RowRunner(lm)
            batch = runner.encode(self.windows, batch_size)
            hidden = runner.final(batch, {}, torch.arange(len(self.windows), device=lm.device))
            self.base = [next_logprobs(lm.head, h, len(w)) for h, w in zip(hidden, self.windows)]
        self.tokens = sum(len(t) for t in self.next)
        self.base_nll = float(-sum(b.gather(1, t[:, None]).sum() for b, t in zip(self.base, self.next)))

    def measure(self, op, strengths):
        """An `Evaluation` of `op` (an Operation) at `strengths`."""
        strengths = check_strengths(strengths)
        with torch.inference_mode():
            runner = self._runner(op)
            diff = self.logit_diffs(op, strengths, runner)
            kl, nll = self._side_effects(op, strengths, runner)
        return self._result(op, strengths, diff.cpu(), kl, nll)

    def _runner(self, op):
        return RowRunner(op.build(self.lm), varies=op.inputs(torch.zeros(1)))

    def logit_diffs(self, op, strengths, runner=None):
        """The A/B logit differences (S, N) float64 of `op` at `strengths` (S) on the N examples
        (`runner`: a `RowRunner` of `op` already built). A schedule's "prompt" is an example's prompt
        and "generated" its answer; a prompt the operation leaves alone runs once per text."""
        lm, ans, strengths = self.lm, self.answers, check_strengths(strengths)
        with torch.inference_mode():
            runner = self._runner(op) if runner is None else runner
            diff = torch.zeros(len(strengths), len(self.data), dtype=torch.float64, device=lm.device)
            batch = runner.encode(ans.texts, self.batch_size, prompts=ans.prompts)
            for which, s_index, inputs in self._chunks(op, runner, strengths, batch["lengths"]):
                hidden = runner.final(batch, inputs, which)
                score, r, ex = answer_logprobs(lm.head, hidden, which, ans, batch["lengths"])
                diff.index_put_((s_index[r], ex), score.double(), accumulate=True)
        return diff

    def _side_effects(self, op, strengths, runner):
        """(KL, NLL) summed over the neutral text's positions, per strength; the operation acts on
        every position there (neutral text has no prompt)."""
        kl, nll = [0.0] * len(strengths), [0.0] * len(strengths)
        batch = runner.encode(self.windows, self.batch_size)
        for which, s_index, inputs in self._chunks(op, runner, strengths, batch["lengths"]):
            hidden = runner.final(batch, inputs, which)
            for h, w, s in zip(hidden, which.tolist(), s_index.tolist()):
                k, e = side_effects(next_logprobs(self.lm.head, h, len(self.windows[w])), self.base[w],
                                    self.next[w])
                kl[s] += k
                nll[s] += e
        return kl, nll

    def _chunks(self, op, runner, strengths, lengths):
        """(texts (R,), strength index (R,), inputs {name: (R,)}) per call of at most `batch_size`
        rows: every strength of a text in the same call where they fit (a shared prompt then runs
        once), texts of like lengths together (less padding)."""
        device, S = self.lm.device, len(strengths)
        values = torch.tensor(strengths, dtype=torch.float32, device=device)
        order = torch.argsort(lengths, stable=True)
        per = max(1, self.batch_size // S)  # texts a call
        for g in range(0, len(order), per):
            texts = order[g:g + per]
            which, s_index = texts.repeat_interleave(S), torch.arange(S, device=device).repeat(len(texts))
            for start in range(0, len(which), self.batch_size):  # more strengths than batch_size: split
                if g or start:
                    turn()  # others may run between calls (`kvwire.steer.turns`)
                rows = slice(start, start + self.batch_size)
                yield which[rows], s_index[rows], row_inputs(op, runner, values[s_index[rows]])

    def _result(self, op, strengths, diff, kl, nll):
        s = torch.tensor(strengths, dtype=torch.float64)
        centred = s - s.mean()
        slopes = (centred[:, None] * (diff - diff.mean(0))).sum(0) / (centred ** 2).sum()  # (N,)
        base = math.exp(self.base_nll / self.tokens)
        ppl = [math.exp(e / self.tokens) for e in nll]
        return Evaluation(op.label, self.data.name, list(strengths), diff.mean(1).tolist(), diff.T.tolist(),
                          slopes.tolist(), float(slopes.mean()),
                          float(slopes.std()) if len(slopes) > 1 else 0.0, float((slopes < 0).double().mean()),
                          [k / self.tokens for k in kl], ppl, base, [p / base - 1 for p in ppl], self.tokens)


def row_inputs(op, runner, values):
    """`op`'s runtime inputs for rows of strengths `values` (R,), checked against the model's."""
    inputs = op.inputs(values)
    unknown = sorted(set(inputs) - set(runner.runtime_inputs))
    if unknown:
        raise ValueError(f"operation {op.label!r} sets runtime inputs {unknown}, which the model it builds does not "
                         f"have; it has {sorted(runner.runtime_inputs) or 'none'}")
    dtypes = runner.runtime_inputs
    return {k: torch.as_tensor(v).to(device=values.device, dtype=dtypes[k]).expand(len(values)).contiguous()
            for k, v in inputs.items()}


def check_strengths(strengths):
    """`strengths` as a list of floats: at least two distinct finite numbers (a slope needs two)."""
    if isinstance(strengths, (str, bytes)) or not hasattr(strengths, "__iter__"):
        raise TypeError(f"strengths must be a list of numbers, got {strengths!r:.60}")
    out = []
    for s in strengths:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ValueError(f"strengths must be finite numbers, got {s!r} in {list(strengths)!r:.80}")
        out.append(float(s))
    if len(set(out)) < 2:
        raise ValueError(f"strengths must hold at least two different numbers (a slope needs two), got {out}")
    return out
