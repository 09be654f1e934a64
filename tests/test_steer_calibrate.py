"""`kw.steer.calibrate` finds the block and sign of a direction planted in a tiny model, keeps to its
damage limit (and says what it found when nothing does), and the `kvwire steer eval` / `calibrate`
commands write what the Python API returns."""
import json

import pytest
import torch

import kvwire as kw
from kvwire import cli

from .conftest import tiny_hf_gemma3
from .test_hf_folder import _tokenizer_json
from .test_steer_evaluate import tiny

# prompts without the letters A and B; the answer is the letter after "("
RECORDS = [(p, "A", "B") for p in ("Pick one: (", "Which? (", "Say it: (", "Now: (", "Go on: (", "Choose: (")]
STRENGTHS = [-4.0, -2.0, 0.0, 2.0, 4.0]


def planted():
    """A tiny llama whose head reads 'A' over 'B' along a planted direction p, and a vector that holds
    -2w at block 2 (w: the unit direction of the residual stream that the final norm and head read
    A - B from) and directions orthogonal to w at blocks 0, 1 and 3."""
    _, lm = tiny()
    g = torch.Generator().manual_seed(7)
    p = torch.nn.functional.normalize(torch.randn(32, generator=g), dim=0)
    a, b = (lm.tokenizer.encode(c, add_bos=False)[0] for c in "AB")
    with torch.no_grad():
        lm.head.weight[a] += 10 * p
        lm.head.weight[b] -= 10 * p
        w = torch.nn.functional.normalize(lm.backbone.norm.weight * (lm.head.weight[a] - lm.head.weight[b]), dim=0)
    others = {i: torch.randn(32, generator=g) for i in (0, 1, 3)}
    others = {i: 2 * torch.nn.functional.normalize(d - (d @ w) * w, dim=0) for i, d in others.items()}
    return lm, kw.ControlVector({**others, 2: -2 * w})


def test_calibrate_finds_the_planted_block_and_sign_and_keeps_to_its_limit(tmp_path):
    lm, vec = planted()
    free = kw.steer.calibrate(lm, vec, RECORDS, strengths=STRENGTHS, max_kl=None, max_ppl_increase=None,
                              neutral="Now is the time for all good men.")
    assert free.candidates == ["0", "1", "2", "3"] and free.settings[2] == [2, "block_out"]
    assert free.choice["layer"] == 2 and free.choice["strength"] == -4.0  # the block, and the sign: negative
    assert free.logit_diff[2][0] > max(row[0] for k, row in enumerate(free.logit_diff) if k != 2) + 1
    kl = free.kl[2]
    limit = (kl[0] + kl[1]) / 2  # -4 breaks it, -2 keeps to it
    assert kl[1] < limit < kl[0]
    kept = kw.steer.calibrate(lm, vec, RECORDS, strengths=STRENGTHS, max_kl=limit, max_ppl_increase=None,
                              neutral="Now is the time for all good men.")
    assert kept.choice["layer"] == 2 and kept.choice["strength"] == -2.0 and kept.choice["kl"] <= limit
    assert not kept.allowed[2][0] and all(k <= limit for row_kl, row_ok in zip(kept.kl, kept.allowed)
                                         for k, ok in zip(row_kl, row_ok) if ok)
    assert not any(row[STRENGTHS.index(0.0)] for row in kept.allowed)  # strength 0 is never chosen
    # the chosen vector: block 2 only, scaled so that strength 1 applies the choice
    assert kept.vector.layers == [2] and torch.allclose(kept.vector.directions[2], -2.0 * vec.directions[2])
    again = kw.steer.evaluate(lm, kept.vector, RECORDS, [0.0, 1.0], neutral="Now is the time for all good men.")
    assert again.logit_diff[1] == pytest.approx(kept.choice["logit_diff"], abs=1e-4)
    assert kept.vector.strength == 1.0  # the file says so: strength 1 applies the choice
    ablation = kw.steer.calibrate(lm, kw.ControlVector(vec.directions, operation="ablate"), RECORDS,
                                  strengths=[0.5, 1.0], layers=[2], max_kl=None, max_ppl_increase=None,
                                  neutral="Now is the time for all good men.")
    assert ablation.vector.strength == ablation.choice["strength"]  # ablations keep their direction
    ablation.vector.save(tmp_path / "ablate.gguf")
    saved = kw.ControlVector.load(tmp_path / "ablate.gguf")
    assert saved.strength == ablation.choice["strength"] and saved.operation == "ablate"
    back = json.loads(kept.to_json(tmp_path / "c.json"))
    assert back["choice"] == kept.choice and back["choice_index"] == [2, 1]
    kept.plot(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_calibrate_bad_input():
    lm, vec = planted()
    with pytest.raises(ValueError, match=r"no setting keeps KL <= 0.0 and the perplexity increase <= None \(strength "
                                         r"0 does not count\); the best found: layer 2 at strength -4: logit "
                                         r"difference \+.*; the least damaging: layer"):
        kw.steer.calibrate(lm, vec, RECORDS, layers=[1, 2], strengths=[-4, 0, 4], max_kl=0.0, max_ppl_increase=None,
                           neutral="Now is the time.")
    with pytest.raises(ValueError, match=r"layer indices \[7\] are not blocks of this model: it has blocks 0-3"):
        kw.steer.calibrate(lm, vec, RECORDS, layers=[1, 7], strengths=[-1, 1])
    with pytest.raises(ValueError, match=r"the vector has no direction for blocks \[1\]; it has blocks \[2\]"):
        kw.steer.calibrate(lm, kw.ControlVector({2: vec.directions[2]}), RECORDS, layers="1-2", strengths=[-1, 1])
    with pytest.raises(ValueError, match=r"max_kl must be a finite number >= 0 or None, got -1"):
        kw.steer.calibrate(lm, vec, RECORDS, strengths=[-1, 1], max_kl=-1)
    with pytest.raises(ValueError, match=r"sites must be among .*got \['middle'\]"):
        kw.steer.calibrate(lm, vec, RECORDS, strengths=[-1, 1], sites=["middle"])


@pytest.fixture
def folder(tmp_path):
    """A tiny gemma3 checkpoint folder with a byte-level tokenizer."""
    tiny_hf_gemma3(vocab_size=300, eos_token_id=0).save_pretrained(tmp_path / "model")
    _tokenizer_json(tmp_path / "model", 300)
    return tmp_path


def test_eval_and_calibrate_commands_write_what_the_api_returns(folder, capsys):
    model = str(folder / "model")
    lm = kw.load(model)
    width = lm.head.weight.shape[1]
    vec = kw.ControlVector({i: torch.randn(width, generator=torch.Generator().manual_seed(i)) for i in (1, 2)},
                           model_hint="gemma3")
    vec.save(folder / "vec.gguf")
    data = folder / "ab.jsonl"
    data.write_text("\n".join(json.dumps({"question": q, "answer_matching_behavior": " the cat",
                                          "answer_not_matching_behavior": " the mat"}) for q in ("sat on", "the")))
    (folder / "neutral.txt").write_text("the theory of the cat")
    common = ["--control-vector", str(folder / "vec.gguf"), "--dataset", str(data), "--strengths", "-1", "0", "2",
              "--neutral", str(folder / "neutral.txt"), "--model", model]
    assert cli.main(["steer", "eval", *common, "--json", str(folder / "e.json"), "--plot", str(folder / "e.png")]) == 0
    out = capsys.readouterr().out
    assert "| strength | logit diff | KL | perplexity |" in out and "steerability" in out
    got = json.loads((folder / "e.json").read_text())
    want = kw.steer.evaluate(lm, vec, str(data), [-1, 0, 2], neutral="the theory of the cat")
    assert got["logit_diff"] == pytest.approx(want.logit_diff, abs=1e-5) and got["kl"] == pytest.approx(want.kl)
    assert (folder / "e.png").read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["steer", "eval", *common, "--generated-only", "--json", str(folder / "g.json")]) == 0
    answers = kw.steer.evaluate(lm, kw.steer.Operation.of(vec, when="generated"), str(data), [-1, 0, 2],
                                neutral="the theory of the cat")
    got = json.loads((folder / "g.json").read_text())
    assert got["logit_diff"] == pytest.approx(answers.logit_diff, abs=1e-5) and got["operation"].endswith("generated positions")
    assert got["logit_diff"] != pytest.approx(want.logit_diff, abs=1e-3)  # the prompts are not steered
    assert cli.main(["steer", "calibrate", *common, "--max-kl", "100", "--max-ppl-increase", "100", "--json",
                     str(folder / "c.json"), "--plot", str(folder / "c.png"), "-o", str(folder / "best.gguf")]) == 0
    report = json.loads((folder / "c.json").read_text())
    best = kw.ControlVector.load(folder / "best.gguf")
    assert best.layers == [report["choice"]["layer"]] and report["choice"]["strength"] in (-1.0, 2.0)
    assert f"chosen: block {report['choice']['layer']}" in capsys.readouterr().out
    assert cli.main(["steer", "calibrate", *common, "--max-kl", "0", "--max-ppl-increase", "0"]) == 2
    assert "kvwire: error: no setting keeps KL <= 0.0" in capsys.readouterr().err
