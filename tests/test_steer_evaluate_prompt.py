"""`kw.steer.evaluate` with scheduled operations: an example's prompt is the prompt and its answer
what is generated; an operation that leaves the prompt alone has it run once per text, to the same
numbers as transformers with hooks on the answer positions and as rows run whole."""
import numpy as np
import pytest
import torch

import kvwire as kw
from kvwire.steer import ABDataset, Operation
from kvwire.steer.evaluate import Reference
from kvwire.steer.gate import Gate, GatedInsert
from kvwire.steer.ops import Ablate
from kvwire.steer.rows import RowRunner

from .test_steer_evaluate import NEUTRAL, RECORDS, _sae, tiny
from .test_steer_ops import hf_logits

STRENGTHS = [-2.0, 0.0, 1.5, 3.0]


def hf_diffs(hf, tok, layer, site, v, s, records=RECORDS):
    """A/B logit differences (N,) with transformers, `s * v` added at `site` of block `layer` at the
    answer's positions only (each prompt + answer run alone)."""
    out = []
    for ex in ABDataset.from_records(records):
        prompt = tok.encode(ex.prompt)
        score = []
        for answer in (ex.positive, ex.negative):
            a = tok.encode(answer, add_bos=False)

            def add(x, n=len(prompt)):
                x = x.clone()
                x[:, n:] += s * v
                return x
            logp = hf_logits(hf, torch.tensor([prompt + a]), [(layer, site, add)])[0].double().log_softmax(-1)
            score.append(sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(a)))
        out.append(score[0] - score[1])
    return out


@pytest.mark.parametrize("family,layer,site", [("llama", 2, "block_out"), ("gemma3", 1, "mlp_out")])
def test_a_generated_schedule_steers_the_answers_alone_as_transformers_does(family, layer, site):
    hf, lm = tiny(family)
    v = torch.randn(lm.head.weight.shape[1], generator=torch.Generator().manual_seed(4))
    op = Operation.add(kw.ControlVector({layer: v}, site=site), when="generated")
    got = kw.steer.evaluate(lm, op, RECORDS, STRENGTHS, neutral=NEUTRAL, neutral_tokens=24, batch_size=5)
    want = np.array([hf_diffs(hf, lm.tokenizer, layer, site, v, s) for s in STRENGTHS]).T  # (N, S)
    # answers of several tokens move; one-token answers are read off the prompt's last position, unsteered
    assert np.ptp(want[:2], axis=1).min() > 1e-3 and np.ptp(want[2]) == 0
    np.testing.assert_allclose(got.per_example, want, atol=2e-4)
    everywhere = kw.steer.evaluate(lm, Operation.add(kw.ControlVector({layer: v}, site=site)), RECORDS, STRENGTHS,
                                   neutral=NEUTRAL, neutral_tokens=24)
    assert np.abs(np.array(everywhere.per_example) - want).max() > 1e-2  # the prompt's steering is left out
    np.testing.assert_allclose(got.kl, everywhere.kl, rtol=1e-5, atol=1e-7)  # neutral text: every position


def _operations(lm):
    g = torch.Generator().manual_seed(6)
    width = lm.head.weight.shape[1]
    d, u = torch.randn(2, width, generator=g), torch.randn(width, generator=g)
    return [Operation.add(kw.ControlVector({1: u}), when="generated"),
            Operation.add(kw.ControlVector({0: u, 2: -u}), when=12),  # the longest prompt here is 12 tokens
            Operation.ablate(d, layers=[1, 2], when="generated"),
            Operation.clamp(u, layers=[2], bound="lo", when="generated"),
            Operation.features(_sae(width, g), {3: 1.0, 5: -2.0}, when="generated")]


@pytest.mark.parametrize("batch_size", [3, 64])
def test_shared_prompts_give_the_numbers_of_rows_run_whole(batch_size, monkeypatch):
    _, lm = tiny()
    reference = Reference(lm, RECORDS, NEUTRAL, 24, batch_size)
    runs = []
    real = RowRunner._prompts
    monkeypatch.setattr(RowRunner, "_prompts", lambda self, batch, texts: runs.append(len(texts)) or
                        real(self, batch, texts))
    for op in _operations(lm):
        runs.clear()
        got = reference.logit_diffs(op, STRENGTHS)
        # each text's prompt ran once, whether its strengths share a call (64) or not (3 < 4 strengths)
        assert sum(runs) == len(reference.answers.texts), (op.label, runs)
        whole = RowRunner(op.build(lm), split=False, varies=op.inputs(torch.zeros(1)))
        batch = whole.encode(reference.answers.texts, prompts=reference.answers.prompts)
        assert not batch["shared"]
        with torch.inference_mode():
            want = torch.stack([_diffs(lm, whole, batch, reference, op, s) for s in STRENGTHS])
        moved = want[:, :2]  # the last example's one-token answers are read off its unsteered prompt
        assert float((moved.max(0).values - moved.min(0).values).min()) > 1e-4, op.label
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0, msg=op.label)


def _diffs(lm, runner, batch, reference, op, s):
    from kvwire.steer.evaluate import row_inputs
    from kvwire.steer.scoring import answer_logprobs

    which = torch.arange(len(reference.answers.texts))
    hidden = runner.final(batch, row_inputs(op, runner, torch.full((len(which),), s)), which)
    score, _, ex = answer_logprobs(lm.head, hidden, which, reference.answers, batch["lengths"])
    return torch.zeros(len(reference.data), dtype=torch.float64).index_add_(0, ex, score.double())


def test_the_prompt_is_shared_only_when_no_varied_input_touches_it():
    _, lm = tiny()
    u = torch.randn(lm.head.weight.shape[1], generator=torch.Generator().manual_seed(7))
    answers = Reference(lm, RECORDS, NEUTRAL, 24).answers

    def shared(op):
        runner = RowRunner(op.build(lm), varies=op.inputs(torch.zeros(1)))
        return runner.encode(answers.texts, prompts=answers.prompts)["shared"]

    vec = kw.ControlVector({1: u})
    assert shared(Operation.add(vec, when="generated")) and shared(Operation.add(vec, when=(40, 50)))
    for when in (None, "all", "prompt", 3, (0, 5)):
        assert not shared(Operation.add(vec, when=when)), when
    # a varied input read by a probe: not a schedule, so the prompt is not assumed alike
    probe = Gate(u, layer=1, site="block_out").probe()
    gated = Operation(lambda m: m.edit(GatedInsert("layers.1.block_out", probe,
                                                   {"layers.2.mlp_out": Ablate(u, when="generated")}), depth="layer"),
                      lambda s: {"gate_threshold": s}, "threshold sweep")
    assert not shared(gated)
    # the same tokens after prompts of other lengths are two texts, steered apart
    records = [("ab", "cd", "ce"), ("abc", "d", "e")]
    op = Operation.add(vec, when="generated")
    both = kw.steer.evaluate(lm, op, records, STRENGTHS, neutral=NEUTRAL).per_example
    alone = [kw.steer.evaluate(lm, op, [r], STRENGTHS, neutral=NEUTRAL).per_example[0] for r in records]
    np.testing.assert_allclose(both, alone, atol=2e-5)
    assert len(Reference(lm, records, NEUTRAL).answers.texts) == 2


def test_prompt_lengths_that_do_not_fit_the_texts_are_refused():
    _, lm = tiny()
    runner = RowRunner(lm)
    with pytest.raises(ValueError, match=r"prompt length in 1\.\.its length; got \[0, 2\]"):
        runner.encode([[1, 2, 3], [4, 5]], prompts=[0, 2])
    with pytest.raises(ValueError, match="each of the 2 texts"):
        runner.encode([[1, 2, 3], [4, 5]], prompts=[1])
