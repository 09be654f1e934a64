"""lm-evaluation-harness: the "kvwire" model on local tasks (YAML over JSONL written here, no downloads)
gives kvwire's own scores (`lm.score`) and generations, unsteered and steered; `kvwire eval` writes results."""
import functools
import importlib
import json
import sys

import pytest
import torch

import kvwire as kw
from kvwire import cli

from .conftest import tiny_hf_gemma3
from .test_hf_folder import _tokenizer_json

pytest.importorskip("lm_eval")

MC = [{"question": "the cat sat on", "choices": ["the mat", "a theory", "the thing of the cat"], "answer": 0},
      {"question": "a tiny tokenizer", "choices": ["for tests", "sat"], "answer": 1},
      {"question": "the theory of the thing and the cat sat on the mat", "choices": ["again", "the tiny cat"],
       "answer": 0}]
TEXTS = [{"text": "the cat sat on the mat"}, {"text": "a tiny theory of tests"}]
GEN = [{"question": "the cat", "answer": "sat"}, {"question": "a tiny theory of the", "answer": "thing"}]

TASKS = {
    "kvwire_mc": ("mc.jsonl", MC, """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""),
    "kvwire_ppl": ("texts.jsonl", TEXTS, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
"""),
    "kvwire_gen": ("gen.jsonl", GEN, """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["mat"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    tiny_hf_gemma3(vocab_size=300, eos_token_id=0).save_pretrained(root / "model")
    _tokenizer_json(root / "model", 300)
    width = 32  # tiny_hf_gemma3's hidden size
    directions = {i: 20 * torch.randn(width, generator=torch.Generator().manual_seed(i)) for i in (1, 2)}
    kw.ControlVector(directions, model_hint="gemma3").save(root / "vec.gguf")
    tasks = root / "tasks"
    tasks.mkdir()
    for name, (data, rows, body) in TASKS.items():
        (tasks / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / data}\n"
            f"  cache_dir: {root / 'datasets'}\ntest_split: test\n{body}")
    return root


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    skip_env_report(monkeypatch)


def skip_env_report(monkeypatch):
    """lm-eval's results carry torch's environment report (a dozen subprocesses, seconds): not tested here."""
    from lm_eval import evaluator

    monkeypatch.setattr(evaluator, "add_env_info", lambda results: None)


def evaluate(files, model_args, tasks):
    importlib.import_module("kvwire.harness")  # registers "kvwire"
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(files / "tasks"), include_defaults=False)  # lm-eval's own: seconds to index
    return lm_eval.simple_evaluate(model="kvwire", model_args=model_args, tasks=tasks, task_manager=manager,
                                   bootstrap_iters=0, log_samples=True)


def split_ids(lm, context, continuation):
    """lm-eval's split of a (context, continuation) pair: the whole text's ids after the context's."""
    head, whole = lm.tokenizer.encode(context), lm.tokenizer.encode(context + continuation)
    return head, whole[len(head):]


@functools.lru_cache(maxsize=None)
def score(lm, context, continuation):
    """(sum of `lm.score` over the continuation's tokens, whether each is the argmax)."""
    head, tail = split_ids(lm, context, continuation)
    ids = torch.tensor(head + tail)
    with torch.no_grad():
        greedy = bool((lm(ids[None])[0, len(head) - 1:-1].argmax(-1) == ids[len(head):]).all())
    return float(lm.score(ids)[-len(tail):].sum()), greedy


@pytest.mark.parametrize("steer,batch", [(False, "3"), (True, "3"), (False, "auto:2")])
def test_lm_eval_matches_kvwire_scores_and_generations(files, offline, steer, batch):
    lm = kw.load(files / "model")
    args = f"pretrained={files / 'model'},batch_size={batch}"
    if steer:
        lm = lm.steer(kw.ControlVector.load(files / "vec.gguf"), 4.0)
        args += f",control_vector={files / 'vec.gguf'},strength=4"
    out = evaluate(files, args, ["kvwire_mc", "kvwire_ppl", "kvwire_gen"])
    samples = out["samples"]
    assert len(samples["kvwire_mc"]) == 3
    for sample in samples["kvwire_mc"]:
        for (context, continuation), [(got, greedy)] in zip(sample["arguments"], sample["resps"]):
            want, want_greedy = score(lm, context, continuation)
            assert got == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    correct = [max(range(len(d["choices"])), key=lambda c: score(lm, d["question"], " " + d["choices"][c])[0])
               == d["answer"] for d in MC]
    assert out["results"]["kvwire_mc"]["acc,none"] == pytest.approx(sum(correct) / len(MC))
    bos = lm.tokenizer.bos_token_id
    assert len(samples["kvwire_ppl"]) == len(TEXTS)
    for sample in samples["kvwire_ppl"]:
        (text,), [[got]] = sample["arguments"][0], sample["resps"]
        want = float(lm.score(torch.tensor([bos] + lm.tokenizer.encode(text))).sum())
        assert got == pytest.approx(want, abs=1e-4)
    for sample in samples["kvwire_gen"]:
        (context, _), [[got]] = sample["arguments"][0], sample["resps"]
        assert got == lm.generate(context, max_new_tokens=6, stop=["mat"])
    if steer:  # the steering reached lm-eval's numbers: they differ from the unsteered model's
        plain = kw.load(files / "model")
        context, continuation = samples["kvwire_mc"][0]["arguments"][0]
        assert abs(samples["kvwire_mc"][0]["resps"][0][0][0] - score(plain, context, continuation)[0]) > 1e-2


def test_shared_contexts_score_as_whole_rows(files):
    """Contexts shared by several continuations run once, left-padded with others; each row's log-probs
    equal `lm.score` of its joined ids, whatever the batch size (packing changes, the numbers do not)."""
    from kvwire.harness import continuation_logprobs

    lm = kw.load(files / "model")
    pairs = [split_ids(lm, d["question"], " " + c) for d in MC for c in d["choices"]]
    pairs.append(([5], [7]))  # a one-token context and continuation
    want = [lm.score(torch.tensor(head + tail))[-len(tail):] for head, tail in pairs]
    for batch_size in (1, 4):
        for w, (logprobs, _) in zip(want, continuation_logprobs(lm, pairs, batch_size=batch_size)):
            torch.testing.assert_close(logprobs, w, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="request 1 has 2 context and 0 continuation tokens"):
        continuation_logprobs(lm, [([1], [2]), ([1, 2], [])])


def test_auto_batches_take_the_rows_that_fit_the_memory_left(files, monkeypatch):
    from kvwire.harness import continuation_logprobs, scoring
    from kvwire.serve.memory import cache_bytes

    lm = kw.load(files / "model")
    row = 2 * cache_bytes(lm.runner().graph, 1, 40) + 40 * lm.head.weight.shape[1] * 4
    assert [scoring.auto_rows(lm, 40, 64, budget=b) for b in (0, 5 * row, 5 * row - 1, 1000 * row)] == [1, 5, 4, 64]
    pairs = [split_ids(lm, d["question"], " " + c) for d in MC for c in d["choices"]]
    want = [lm.score(torch.tensor(head + tail))[-len(tail):] for head, tail in pairs]
    sizes, real = [], scoring._score_batch
    monkeypatch.setattr(scoring, "_score_batch",
                        lambda runner, contexts, conts: sizes.append(sum(map(len, conts))) or real(runner, contexts, conts))
    for free, most, batches in ((0, 64, [len(d["choices"]) for d in MC]), (1 << 40, 64, [len(pairs)]),
                                (1 << 40, len(pairs) - 1, None)):
        monkeypatch.setattr(scoring, "available_bytes", lambda: (free, "test"))
        sizes.clear()
        got = continuation_logprobs(lm, pairs, batch_size="auto", max_batch_size=most)
        for w, (logprobs, _) in zip(want, got):
            torch.testing.assert_close(logprobs, w, atol=1e-5, rtol=0)
        assert sorted(sizes) == sorted(batches) if batches else len(sizes) == 2 and max(sizes) <= most, sizes
    monkeypatch.setattr(scoring, "available_bytes", lambda: (None, "no /proc/meminfo"))
    assert scoring.auto_rows(lm, 40, 64) == scoring.FALLBACK_ROWS


def test_eval_command_writes_results(files, capsys, monkeypatch):
    from lm_eval import tasks

    # indexing lm-eval's own tasks (thousands of files) takes seconds; --include_path's are the ones used
    monkeypatch.setattr(tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False))
    skip_env_report(monkeypatch)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = files / "results"
    assert cli.main(["eval", "--model_args", f"pretrained={files / 'model'}", "--tasks", "kvwire_mc",
                     "--include_path", str(files / "tasks"), "--output_path", str(out), "--batch_size", "4"]) == 0
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == os.environ["HF_HUB_OFFLINE"] == "1"
    [written] = out.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]
    lm = kw.load(files / "model")
    correct = [max(range(len(d["choices"])), key=lambda c: score(lm, d["question"], " " + d["choices"][c])[0])
               == d["answer"] for d in MC]
    assert results["kvwire_mc"]["acc,none"] == pytest.approx(sum(correct) / len(MC))
    assert "kvwire_mc" in capsys.readouterr().out
    assert cli.main(["eval", "--tasks", "no_such_task", "--include_path", str(files / "tasks")]) == 2
    assert "unknown tasks ['no_such_task']" in capsys.readouterr().err


def test_ablate_and_clamp_model_args_edit_as_lm_ablate_and_clamp(files):
    from kvwire.harness import KvwireLM

    model, path = str(files / "model"), str(files / "vec.gguf")
    lm, vec = kw.load(model), kw.ControlVector.load(path)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    for args, want in [(dict(ablate=path), lm.ablate(vec)),
                       (dict(clamp=path, clamp_lo=-1, clamp_hi=1), lm.clamp(vec, -1.0, 1.0)),
                       (dict(clamp=path, clamp_hi=0.5), lm.clamp(vec, None, 0.5))]:
        got = KvwireLM(pretrained=model, **args).lm.score(ids)
        torch.testing.assert_close(got, want.score(ids), atol=1e-6, rtol=0)
        assert (got - lm.score(ids)).abs().max() > 1e-2, args  # the edit changed the model


def test_bad_model_args_are_refused(files):
    from kvwire.harness import KvwireLM

    model = str(files / "model")
    with pytest.raises(ValueError, match="strength=4 needs control_vector=PATH"):
        KvwireLM(pretrained=model, strength=4)
    for bad in ("auto:0", "automatic", 0):
        with pytest.raises(ValueError, match=f"batch_size must be a positive int, 'auto' or 'auto:N' for the "
                                             f"kvwire model, got {bad!r}"):
            KvwireLM(pretrained=model, batch_size=bad)
    with pytest.raises(ValueError, match="max_batch_size must be a positive int for the kvwire model, got 'auto'"):
        KvwireLM(pretrained=model, batch_size="auto", max_batch_size="auto")
    with pytest.raises(ValueError, match=r"clamp=.*needs clamp_lo, clamp_hi or both"):
        KvwireLM(pretrained=model, clamp=str(files / "vec.gguf"))
    lm = KvwireLM(pretrained=model)
    with pytest.raises(ValueError, match=r"generation options \['num_beams'\] are not taken by the kvwire model"):
        lm._generation({"num_beams": 2})


def test_missing_extra_names_it(monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith(("lm_eval.", "kvwire.harness"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'kvwire\[eval\]'"):
        importlib.import_module("kvwire.harness")
    assert cli.main(["eval", "--tasks", "anything"]) == 2
    assert "pip install 'kvwire[eval]'" in capsys.readouterr().err
