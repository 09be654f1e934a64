"""Pictures of layer graphs, and the `kvwire steer train` / `--control-vector` / `plot` commands."""
import pytest
import torch

import kvwire as kw
from kvwire.graph.draw import INSERTED
from kvwire import cli

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2
from .test_hf_folder import _tokenizer_json


def test_plot_marks_inserted_layers_and_cache_wiring(tiny_lm, tmp_path):
    width = tiny_lm.head.weight.shape[1]
    steered = tiny_lm.steer(kw.ControlVector({1: torch.ones(width), 2: torch.ones(width)}), 2.0)
    blocks = kw.block_calls(tiny_lm.backbone)
    plain = kw.plot(tiny_lm.backbone).source
    edited = kw.plot(steered).source
    assert "Steer" not in plain
    for i in (1, 2):
        assert f"{blocks[i].replace('.', '_')}__Steer" in edited
    assert edited.count(INSERTED) == 2
    cached = kw.plot(steered.cached).source
    n = len(steered.cached.slots)
    for i in range(n):
        assert f"cache[{i}]" in cached and f"next cache[{i}]" in cached
    assert "steer_strength" in cached and cached.count("(cached)") == n
    out = tmp_path / "graph.svg"
    kw.plot(steered, out)
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "__Steer" in svg
    kw.plot(steered.cached, tmp_path / "cached.dot")
    assert "next cache[0]" in (tmp_path / "cached.dot").read_text()


def test_plot_bad_path_and_object(tiny_lm, tmp_path):
    with pytest.raises(ValueError, match=r"plot path must end in one of \['.dot', '.gv', '.pdf'"):
        kw.plot(tiny_lm, tmp_path / "graph.jpg")
    with pytest.raises(TypeError, match="plot expects an nn.Module, a CausalLM or a CachedGraph, got str"):
        kw.plot("model", tmp_path / "graph.svg")


@pytest.fixture
def folder(tmp_path):
    hf = tiny_hf_gemma3(vocab_size=300, eos_token_id=0)
    hf.save_pretrained(tmp_path / "model")
    _tokenizer_json(tmp_path / "model", 300)
    return tmp_path


def test_steer_train_generate_and_plot_commands(folder, capsys):
    model = str(folder / "model")
    (folder / "pos.txt").write_text("the cat sat\nthe theory\n\na tiny cat\n")
    (folder / "neg.txt").write_text("the mat sat\nthe thing\na tiny mat\n")
    vec_path = folder / "vec.gguf"
    assert cli.main(["steer", "train", "--positive", str(folder / "pos.txt"), "--negative", str(folder / "neg.txt"),
                     "--layers", "1-3", "-o", str(vec_path), "--model", model]) == 0
    vec = kw.ControlVector.load(vec_path)
    assert vec.layers == [1, 2, 3] and vec.model_hint == "gemma3"
    capsys.readouterr()
    args = ["generate", "the cat", "--model", model, "--max-new-tokens", "6", "--no-stream"]
    assert cli.main(args + ["--control-vector", str(vec_path), "--strength", "8"]) == 0
    steered_text = capsys.readouterr().out
    lm = kw.load(model)
    assert steered_text == "the cat" + lm.steer(vec, 8.0).generate("the cat", max_new_tokens=6) + "\n"
    assert cli.main(["plot", str(folder / "g.svg"), "--model", model, "--control-vector", str(vec_path)]) == 0
    assert "__Steer" in (folder / "g.svg").read_text()
    assert cli.main(["plot", str(folder / "c.dot"), "--model", model, "--cached"]) == 0
    assert "next cache[3]" in (folder / "c.dot").read_text()


def test_steer_train_command_reports_bad_input(folder, capsys):
    model = str(folder / "model")
    (folder / "pos.txt").write_text("a\nb\n")
    (folder / "neg.txt").write_text("c\n")
    assert cli.main(["steer", "train", "--positive", str(folder / "pos.txt"), "--negative", str(folder / "neg.txt"),
                     "-o", str(folder / "v.gguf"), "--model", model]) == 2
    assert "got 2 positive and 1 negative" in capsys.readouterr().err
    hf = tiny_hf_gpt2(vocab_size=300)
    from .gguf_files import write_gpt2
    write_gpt2(folder / "m.gguf", hf)
    assert cli.main(["generate", "hi", "--model", model, "--control-vector", str(folder / "m.gguf")]) == 2
    assert "is not a control vector" in capsys.readouterr().err
