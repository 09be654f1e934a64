"""`kw.steer.evaluate`: its numbers == the same computation with transformers (forward hooks adding
the vector), every operation batched over strengths == each strength built alone, the shipped
dataset, results as JSON and pictures, and bad input."""
import json

import numpy as np
import pytest
import torch

import kvwire as kw
from kvwire.steer import ABDataset, Operation, SAE
from kvwire.steer.rows import RowRunner

from .conftest import FAMILIES
from .test_steer_ops import hf_logits, ref_add
from .tokenizers_for_tests import char_level

# answers of several tokens and of different lengths; the last two share all but their last token
RECORDS = [{"prompt": "Q: sun? A:", "positive": " yes", "negative": " no"},
           {"question": "the cat sat", "answer_matching_behavior": " on it", "answer_not_matching_behavior": " off"},
           ("Pick one: (", "A", "B")]
NEUTRAL = "The river begins as a thin stream high in the hills, past a mill."  # 3 rows of 24 tokens
STRENGTHS = [-2.0, -0.5, 0.0, 1.0, 3.0]


def tiny(family="llama"):
    hf = FAMILIES[family](vocab_size=100)
    lm = kw.from_hf(hf)
    lm.tokenizer = char_level()
    return hf, lm


def hf_reference(hf, tok, hooks):
    """(logit diffs (N,), KL summed, NLL summed, tokens) computed plainly with transformers."""
    diffs = []
    for ex in ABDataset.from_records(RECORDS):
        prompt = tok.encode(ex.prompt)
        score = []
        for answer in (ex.positive, ex.negative):
            a = tok.encode(answer, add_bos=False)
            logp = hf_logits(hf, torch.tensor([prompt + a]), hooks)[0].double().log_softmax(-1)
            score.append(sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(a)))
        diffs.append(score[0] - score[1])
    ids = tok.encode(NEUTRAL)
    kl = nll = n = 0.0
    for i in range(0, len(ids), 24):
        w = torch.tensor([ids[i:i + 24]])
        base = hf_logits(hf, w, [])[0, :-1].double().log_softmax(-1)
        steered = hf_logits(hf, w, hooks)[0, :-1].double().log_softmax(-1)
        kl += float((base.exp() * (base - steered)).sum())
        nll -= float(steered.gather(1, w[0, 1:, None]).sum())
        n += w.shape[1] - 1
    return np.array(diffs), kl, nll, n


@pytest.mark.parametrize("family,layer,site", [("llama", 1, "block_out"), ("gemma3", 2, "attn_out")])
def test_evaluate_equals_transformers_with_hooks(family, layer, site):
    hf, lm = tiny(family)
    v = torch.randn(lm.head.weight.shape[1], generator=torch.Generator().manual_seed(3))
    vec = kw.ControlVector({layer: v}, site=site)
    got = kw.steer.evaluate(lm, vec, RECORDS, STRENGTHS, neutral=NEUTRAL, neutral_tokens=24, batch_size=6)
    assert RowRunner(lm.steer(vec, site=site)).lower is not None  # the blocks below ran once per text
    want = [hf_reference(hf, lm.tokenizer, [(layer, site, lambda x, s=s: ref_add(x, v, s))]) for s in STRENGTHS]
    per_example = np.array([w[0] for w in want]).T  # (N, S)
    assert np.ptp(per_example, axis=1).min() > 1e-3  # steering moves every example here
    np.testing.assert_allclose(got.per_example, per_example, atol=2e-4)
    np.testing.assert_allclose(got.logit_diff, per_example.mean(0), atol=2e-4)
    slopes = np.array([np.polyfit(STRENGTHS, row, 1)[0] for row in per_example])
    np.testing.assert_allclose(got.slopes, slopes, atol=1e-4)
    assert got.slope_mean == pytest.approx(slopes.mean(), abs=1e-4)
    assert got.slope_std == pytest.approx(slopes.std(ddof=1), abs=1e-4)
    assert got.anti_steerable == pytest.approx((slopes < 0).mean())
    _, _, base_nll, n = hf_reference(hf, lm.tokenizer, [])
    assert got.neutral_tokens == n
    np.testing.assert_allclose(got.kl, [w[1] / n for w in want], atol=1e-5)
    np.testing.assert_allclose(got.perplexity, [np.exp(w[2] / n) for w in want], rtol=1e-5)
    assert got.base_perplexity == pytest.approx(np.exp(base_nll / n), rel=1e-5)
    assert got.kl[STRENGTHS.index(0.0)] == pytest.approx(0.0, abs=1e-6)
    assert got.ppl_increase == pytest.approx([p / got.base_perplexity - 1 for p in got.perplexity])


def direct(model, lm):
    """Logit differences (N,) of `model` from plain uncached forwards (no runtime inputs)."""
    out = []
    for ex in ABDataset.from_records(RECORDS):
        prompt = lm.encode(ex.prompt)
        score = []
        for answer in (ex.positive, ex.negative):
            a = lm.tokenizer.encode(answer, add_bos=False)
            with torch.no_grad():
                logp = model(torch.tensor([prompt + a]))[0].log_softmax(-1)
            score.append(sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(a)))
        out.append(score[0] - score[1])
    return out


def _sae(width, g):
    return SAE(W_enc=torch.randn(width, 16, generator=g), b_enc=torch.zeros(16),
               W_dec=torch.randn(16, width, generator=g), b_dec=torch.zeros(width), threshold=None,
               hook_name="blocks.1.hook_resid_post")


def test_every_operation_batched_over_strengths_equals_each_strength_alone():
    _, lm = tiny()
    g = torch.Generator().manual_seed(5)
    width = lm.head.weight.shape[1]
    d, u = torch.randn(2, width, generator=g), torch.randn(width, generator=g)
    sae = _sae(width, g)
    cases = [
        (Operation.ablate(d, layers=[1, 2]), [0.0, 0.5, 1.0], lambda s: lm.ablate(d, layers=[1, 2], strength=s)),
        (Operation.clamp(u, layers=[2]), [-1.0, 0.0, 2.0], lambda s: lm.clamp(u, s, s, layers=[2])),
        (Operation.clamp(u, layers=[2], bound="lo"), [-1.0, 2.0], lambda s: lm.clamp(u, lo=s, layers=[2])),
        (Operation.features(sae, {3: 1.0, 5: -2.0}), [0.0, 1.5], lambda s: lm.steer_features(sae, {3: s, 5: -2 * s})),
        (kw.ControlVector({2: u}, operation="clamp"), [-1.0, 1.0], lambda s: lm.clamp(u, s, s, layers=[2])),
        (Operation(lambda m: m.steer(kw.ControlVector({1: u}), name="mine"), lambda s: {"mine_strength": 2 * s},
                   "twice"), [-1.0, 1.0], lambda s: lm.steer(kw.ControlVector({1: u}), 2 * s)),
    ]
    for op, strengths, alone in cases:
        got = kw.steer.evaluate(lm, op, RECORDS, strengths, neutral="The river runs.")
        want = np.array([direct(alone(s), lm) for s in strengths]).T
        np.testing.assert_allclose(got.per_example, want, atol=2e-4, err_msg=Operation.of(op).label)
    assert np.ptp(want) > 1e-3


def test_the_shipped_dataset_loads_by_name_in_caas_layout(tmp_path):
    data = kw.steer.dataset("sentiment-ab")
    assert data.name == "sentiment-ab" and len(data) == 30
    assert {e.positive for e in data} == {" (A", " (B"} and all(e.prompt.endswith("Answer:") for e in data)
    assert all({e.positive, e.negative} == {" (A", " (B"} for e in data)
    positive, negative = data.pairs()
    assert positive[0].endswith("Answer: (A") and negative[0].endswith("Answer: (B")
    assert len(kw.steer.neutral_text().split()) > 300
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r if isinstance(r, dict) else dict(zip(("prompt", "positive", "negative"), r)))
                              for r in RECORDS) + "\n\n")
    assert kw.steer.dataset(str(path)).examples == ABDataset.from_records(RECORDS).examples  # trailing blanks: fine


def test_results_as_json_and_pictures(tmp_path):
    _, lm = tiny()
    vec = kw.ControlVector({1: torch.randn(lm.head.weight.shape[1], generator=torch.Generator().manual_seed(1))})
    got = kw.steer.evaluate(lm, vec, RECORDS, [-1, 1], neutral=NEUTRAL)
    back = json.loads(got.to_json(tmp_path / "e.json"))
    assert back == json.loads((tmp_path / "e.json").read_text()) and back["strengths"] == [-1.0, 1.0]
    assert back["logit_diff"] == got.logit_diff and len(back["per_example"]) == 3
    assert back["operation"] == "add at blocks 1, block_out" and back["dataset"] == "records"
    got.plot(tmp_path / "e.png")
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input(tmp_path):
    _, lm = tiny()
    vec = kw.ControlVector({1: torch.ones(lm.head.weight.shape[1])})
    lines = {"empty": '{"prompt": "a", "positive": "b", "negative": "c"}\n\n{"prompt": "x"}\n',
             "malformed": '{"prompt": "a", "positive": "b", "negative": "c"}\n{"prompt": "a",\n',
             "keys": '{"prompt": "a", "positive": "b", "negative": "c"}\n{"prompt": "x", "positive": "y"}\n',
             "answer": '{"question": "q", "answer_matching_behavior": "", "answer_not_matching_behavior": "B"}\n',
             "same": '{"prompt": "q", "positive": "A", "negative": "A"}\n'}
    for name, text in lines.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    for name, match in [("empty", "empty.jsonl line 2 is empty; expected one JSON object a line"),
                        ("malformed", r"malformed.jsonl line 2 is not valid JSON \(.*\): '\{\"prompt\": \"a\",'"),
                        ("keys", r"keys.jsonl line 2: expected keys \('prompt', 'positive', 'negative'\) .*missing "
                                 r"\['negative'\]"),
                        ("answer", "answer.jsonl line 1: 'answer_matching_behavior' must be a non-empty string"),
                        ("same", r"same.jsonl line 1: the two answers are the same \('A'\)")]:
        with pytest.raises(ValueError, match=match):
            kw.steer.evaluate(lm, vec, str(tmp_path / f"{name}.jsonl"), [0, 1])
    with pytest.raises(ValueError, match="neither a shipped dataset"):
        kw.steer.dataset("no-such-set")
    blank = char_level()
    from tokenizers import normalizers
    blank.backend.normalizer = normalizers.Strip()  # a tokenizer that drops surrounding spaces
    lm.tokenizer = blank
    with pytest.raises(ValueError, match=r"records line 2: the negative answer '  ' encodes to no tokens"):
        kw.steer.evaluate(lm, vec, [("a", "b", "c"), ("a", "b", "  ")], [0, 1])
    lm.tokenizer = char_level()
    with pytest.raises(ValueError, match=r"control vector steers blocks \[9\], but this model has blocks 0-3"):
        kw.steer.evaluate(lm, kw.ControlVector({9: torch.ones(32)}), RECORDS, [0, 1])
    with pytest.raises(ValueError, match=r"strengths must hold at least two different numbers .*got \[1.0, 1.0\]"):
        kw.steer.evaluate(lm, vec, RECORDS, [1, 1])
    with pytest.raises(ValueError, match=r"operation 'bad' sets runtime inputs \['nope'\], which the model"):
        kw.steer.evaluate(lm, Operation(lambda m: m.steer(vec), lambda s: {"nope": s}, "bad"), RECORDS, [0, 1])
    with pytest.raises(TypeError, match="operation must be a kw.steer.Operation or a kw.ControlVector, got str"):
        kw.steer.evaluate(lm, "vec", RECORDS, [0, 1])


def test_the_speed_bench_runs_both_paths_to_equal_numbers(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "bench" / "steer_eval.py"
    spec = importlib.util.spec_from_file_location("steer_eval_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    times = bench.main(["--tiny", "--layers", "2", "--strengths", "3", "--examples", "2", "--no-evaluate"])
    # it checks the two paths agree itself, with the vector on every position and on the answers alone
    assert sorted(times) == [(2, "all"), (2, "generated")] and all(t > 0 for v in times.values() for t in v)
    assert "3 strengths x 2 examples" in capsys.readouterr().out
