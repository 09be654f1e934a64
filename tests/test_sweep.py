"""`kw.steer.sweep`: a probe value and a sample per strength (tiny model), its plot and its command;
on the real default model the default probe rises with the shipped happy vector's strength."""
import json
import math
from pathlib import Path

import pytest
import torch

import kvwire as kw
from kvwire import cli
from kvwire.steer import Sweep, WordGap

from .serve_fixtures import CHATML, backend, control_vectors, tiny_chat_hf, tiny_chat_lm

HAPPY_GGUF = Path(__file__).parent.parent / "examples" / "data" / "happy.gguf"
# byte-level tokenizer: a word's first token is its first byte, so these differ
PROBE = dict(positive=["happy", "joy"], negative=["sad", "gloom"], prompts=["I feel", "Today was"])


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def vec(lm):
    return control_vectors(lm)["happy"]


def gap_by_hand(model, probe):
    ids = {side: [model.tokenizer.encode(w, add_bos=False)[0] for w in PROBE[side]] for side in ("positive", "negative")}
    total = 0.0
    with torch.inference_mode():
        for prompt in PROBE["prompts"]:
            logp = torch.log_softmax(model(torch.tensor([model.tokenizer.encode(prompt)]))[0, -1], -1)
            total += float(logp[ids["positive"]].mean() - logp[ids["negative"]].mean())
    return total / len(PROBE["prompts"])


def test_sweep_measures_and_samples_each_strength(lm, vec):
    probe = WordGap(**PROBE)
    result = kw.steer.sweep(lm, vec, [-2, 0, 1.5], probe=probe, prompt="Once upon", max_new_tokens=4)
    assert isinstance(result, Sweep) and result.strengths == [-2.0, 0.0, 1.5]
    for s, value, sample in zip(result.strengths, result.values, result.samples):
        steered = lm.steer(vec, s)
        assert value == pytest.approx(gap_by_hand(steered, PROBE), abs=1e-5)
        assert sample == steered.generate("Once upon", max_new_tokens=4)
    assert result.values[1] == pytest.approx(gap_by_hand(lm, PROBE), abs=1e-5)  # strength 0: the model itself
    assert len(set(result.values)) == 3 and len(set(result.samples)) > 1
    assert result.probe == "log p(happy,joy) - log p(sad,gloom)" and result.vector_layers == [1, 2]
    table = str(result).splitlines()
    assert table[0] == "| strength | log p(happy,joy) - log p(sad,gloom) | sample: 'Once upon' |"
    assert table[2].startswith(f"| -2.00 | {result.values[0]:+.3f} | ") and len(table) == 5


def test_sweep_takes_any_probe_callable(lm, vec):
    seen = []

    def probe(model):
        seen.append(model)
        return float(model(torch.tensor([[5, 6, 7]]))[0, -1, 0])

    result = kw.steer.sweep(lm, vec, [0.5, -0.5], probe=probe, max_new_tokens=2)
    assert len(seen) == 2 and all(m is not lm for m in seen)
    assert result.probe == "probe" and result.values[0] != result.values[1]


def test_sweep_json_and_plot(lm, vec, tmp_path):
    result = kw.steer.sweep(lm, vec, [-1, 0, 1], probe=WordGap(**PROBE), max_new_tokens=6)
    data = result.to_dict()
    assert json.loads(json.dumps(data)) == data and data["strengths"] == [-1.0, 0.0, 1.0]
    nan = Sweep([0.0], [math.nan], ["x"], "p", "q").to_dict()
    assert nan["values"] == [None]  # JSON has no NaN
    pytest.importorskip("matplotlib")
    import matplotlib.image

    result.plot(tmp_path / "sweep.png")
    image = matplotlib.image.imread(tmp_path / "sweep.png")
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05  # something is drawn


@pytest.mark.parametrize("strengths, error, match", [
    ([], ValueError, r"strengths is empty; expected numbers such as \[-1, 0, 1\]"),
    (["0.5"], ValueError, r"strengths must be finite numbers, got '0.5' in \['0.5'\]"),
    ([0.0, math.inf], ValueError, "strengths must be finite numbers, got inf"),
    ("0.5", TypeError, "strengths must be a list of numbers, got '0.5'"),
])
def test_sweep_bad_strengths(lm, vec, strengths, error, match):
    with pytest.raises(error, match=match):
        kw.steer.sweep(lm, vec, strengths)


def test_sweep_bad_vector_probe_prompt(lm, vec):
    with pytest.raises(TypeError, match="sweep expects a kw.ControlVector, got dict"):
        kw.steer.sweep(lm, {"a": 1}, [0])
    with pytest.raises(ValueError, match="WordGap negative must be a non-empty list of non-empty str, got \\[\\]"):
        WordGap(["a"], [])
    with pytest.raises(ValueError, match="prompt must be a non-empty str, got ''"):
        kw.steer.sweep(lm, vec, [0], prompt="")


def test_steer_sweep_command(tmp_path, capsys, lm, vec):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "model"
    tiny_chat_hf().save_pretrained(folder)
    backend().save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHATML)
    vec.save(tmp_path / "happy.gguf")
    argv = ["steer", "sweep", "--model", str(folder), "--control-vector", str(tmp_path / "happy.gguf"),
            "--strengths", "-1", "1", "--prompt", "Once upon", "--max-new-tokens", "3",
            "--positive-words", "happy", "joy", "--negative-words", "sad", "gloom",
            "--probe-prompt", "I feel", "--probe-prompt", "Today was",
            "--plot", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    expected = kw.steer.sweep(kw.load(folder), vec, [-1, 1], probe=WordGap(**PROBE), prompt="Once upon",
                              max_new_tokens=3)
    assert out.out.strip() == str(expected)
    assert json.loads((tmp_path / "s.json").read_text())["values"] == pytest.approx(expected.values)
    assert (tmp_path / "s.png").stat().st_size > 10_000 and "wrote" in out.err
    assert cli.main(argv[:6] + ["--plot", str(tmp_path / "s.jpg")]) == 2
    assert "--plot must name a .png, .svg or .pdf file, got" in capsys.readouterr().err


@pytest.mark.real
def test_default_probe_rises_with_the_happy_vector(default_lm):
    vec = kw.ControlVector.load(HAPPY_GGUF)
    result = kw.steer.sweep(default_lm, vec, [-0.5, 0.0, 0.5], max_new_tokens=2)  # 3 x 5 probe passes
    assert result.values == sorted(result.values) and result.values[-1] - result.values[0] > 3.0, str(result)
