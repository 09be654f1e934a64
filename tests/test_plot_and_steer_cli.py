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
    (folder / "pos.txt").write_text("the cat sat\nthe theory\n\na tiny cat\n\n")  # blank lines pair up
    (folder / "neg.txt").write_text("the mat sat\nthe thing\n  \na tiny mat\n")
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
    assert "pos.txt has 2 lines and " in capsys.readouterr().err
    (folder / "pos.txt").write_text("a\n\nb\n")  # dropping blanks per file would pair b with c
    (folder / "neg.txt").write_text("c\nd\ne\n")
    assert cli.main(["steer", "train", "--positive", str(folder / "pos.txt"), "--negative", str(folder / "neg.txt"),
                     "-o", str(folder / "v.gguf"), "--model", model]) == 2
    assert "line 2 is blank in " in capsys.readouterr().err and not (folder / "v.gguf").exists()
    hf = tiny_hf_gpt2(vocab_size=300)
    from .gguf_files import write_gpt2
    write_gpt2(folder / "m.gguf", hf)
    assert cli.main(["generate", "hi", "--model", model, "--control-vector", str(folder / "m.gguf")]) == 2
    assert "is not a control vector" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--top-k", "1", "--top-p", "0.9"], "--top-k, --top-p belong to different samplers and cannot be combined"),
    (["--sampler", "random", "--top-k", "1"], "--sampler random does not use --top-k; drop it or use --sampler top-k"),
    (["--sampler", "greedy", "--temperature", "0.5"], "--sampler greedy is deterministic and takes no --temperature"),
    (["--beams", "2", "--min-p", "0.1"], "--min-p, --beams belong to different samplers"),
    (["--max-new-tokens", "-3"], "max_new_tokens must be an int >= 1, got -3"),
])
def test_generate_refuses_before_printing_anything(folder, capsys, options, message):
    assert cli.main(["generate", "the cat", "--model", str(folder / "model"), *options]) == 2
    out, err = capsys.readouterr()
    assert message in err and out == ""  # not even the prompt


def test_cli_sampler_options_reach_the_sampler():
    args = cli.parser().parse_args(["generate", "x", "--top-k", "1", "--temperature", "0.5"])
    assert cli.make_sampler(args) == kw.TopK(1, temperature=0.5)
    args = cli.parser().parse_args(["generate", "x", "--sampler", "top-p", "--top-p", "0.5"])
    assert cli.make_sampler(args) == kw.TopP(0.5)
    args = cli.parser().parse_args(["generate", "x", "--beams", "2", "--repetition-penalty", "1.5"])
    assert cli.make_sampler(args) == kw.BeamSearch(num_beams=2) and args.repetition_penalty == 1.5


def test_generate_with_sites_ablation_and_clamps(folder, capsys):
    model = str(folder / "model")
    g = torch.Generator().manual_seed(3)
    vec = kw.ControlVector({i: torch.randn(32, generator=g) * 4 for i in (1, 2)})
    vec.save(folder / "v.gguf")
    args = ["generate", "the cat", "--model", model, "--max-new-tokens", "6", "--no-stream"]
    lm = kw.load(model)
    cases = [(["--control-vector", str(folder / "v.gguf"), "--site", "mlp_out", "--strength", "2"],
              lm.steer(vec, 2.0, site="mlp_out")),
             (["--ablate", str(folder / "v.gguf"), "--site", "attn_out"], lm.ablate(vec, site="attn_out")),
             (["--clamp", f"{folder / 'v.gguf'}=,-1.5", "--generated-only"], lm.clamp(vec, hi=-1.5, when="generated"))]
    for extra, want in cases:
        capsys.readouterr()
        assert cli.main(args + extra) == 0
        assert capsys.readouterr().out == "the cat" + want.generate("the cat", max_new_tokens=6) + "\n", extra
    assert cli.main(args + ["--clamp", f"{folder / 'v.gguf'}=1"]) == 2
    assert "--clamp takes VEC.gguf=LO,HI (LO or HI may be empty) or VEC.gguf, got" in capsys.readouterr().err
    assert cli.main(args + ["--clamp", str(folder / "v.gguf")]) == 2
    assert "the file recommends no value to hold the projection at; give" in capsys.readouterr().err
    # a file carrying a recommended strength (kw.steer.calibrate's choice) is applied at it
    for op, flag, want in [("add", "--control-vector", lm.steer(vec, 3.0)), ("ablate", "--ablate", lm.ablate(vec, strength=0.5)),
                           ("clamp", "--clamp", lm.clamp(vec, -2.0, -2.0))]:
        kw.ControlVector(vec.directions, operation=op, strength={"add": 3.0, "ablate": 0.5, "clamp": -2.0}[op]).save(
            folder / f"{op}.gguf")
        capsys.readouterr()
        assert cli.main(args + [flag, str(folder / f"{op}.gguf")]) == 0
        assert capsys.readouterr().out == "the cat" + want.generate("the cat", max_new_tokens=6) + "\n", op


def test_steer_train_records_site_operation_and_positions(folder):
    model = str(folder / "model")
    (folder / "pos.txt").write_text("the cat sat\nthe theory\na tiny cat\n")
    (folder / "neg.txt").write_text("the mat sat\nthe thing\na tiny mat\n")
    out = folder / "abl.gguf"
    assert cli.main(["steer", "train", "--positive", str(folder / "pos.txt"), "--negative", str(folder / "neg.txt"),
                     "--layers", "1-2", "--site", "attn_out", "--operation", "ablate", "--positions", "mean",
                     "--method", "mean_diff", "-o", str(out), "--model", model]) == 0
    vec = kw.ControlVector.load(out)
    assert (vec.site, vec.operation, vec.layers) == ("attn_out", "ablate", [1, 2])
    lm = kw.load(model)
    want = kw.ControlVector.train(lm, ["the cat sat", "the theory", "a tiny cat"], ["the mat sat", "the thing", "a tiny mat"],
                                  layers="1-2", site="attn_out", positions="mean", method="mean_diff", progress=False)
    assert all(torch.allclose(vec.directions[i], want.directions[i], atol=1e-5) for i in (1, 2))


def test_generate_with_sae_features(folder, tmp_path, capsys):
    from .test_sae import random_sae, write_sae

    model = str(folder / "model")
    sae_dir = write_sae(tmp_path / "sae", random_sae(), hook_name="blocks.2.hook_resid_post")
    args = ["generate", "the cat", "--model", model, "--max-new-tokens", "6", "--no-stream", "--sae", str(sae_dir)]
    lm = kw.load(model)
    capsys.readouterr()
    assert cli.main(args + ["--feature", "5=8", "--feature", "9=0"]) == 0
    want = lm.steer_features(kw.SAE.load(sae_dir), {5: 8.0, 9: 0.0}).generate("the cat", max_new_tokens=6)
    assert capsys.readouterr().out == "the cat" + want + "\n"
    assert cli.main(args + ["--feature", "5=x"]) == 2
    assert "--feature takes I=V (a feature index and a number), got '5=x'" in capsys.readouterr().err
    assert cli.main(args) == 2
    assert "--sae FOLDER and --feature I=V go together" in capsys.readouterr().err


def test_generate_ablating_heads_and_training_at_the_heads_site(folder, capsys):
    model = str(folder / "model")
    args = ["generate", "the cat", "--model", model, "--max-new-tokens", "6", "--no-stream"]
    lm = kw.load(model)
    capsys.readouterr()
    assert cli.main(args + ["--ablate-heads", "1:0,1", "--ablate-heads", "2:1"]) == 0
    want = lm.ablate(kw.steer.head_basis(lm, {1: [0, 1], 2: [1]}), site="attn_heads").generate("the cat",
                                                                                                max_new_tokens=6)
    assert capsys.readouterr().out == "the cat" + want + "\n"
    assert want != lm.generate("the cat", max_new_tokens=6)
    assert cli.main(args + ["--ablate-heads", "1"]) == 2
    assert "--ablate-heads takes BLOCK:H[,H...] (a block and head indices), got '1'" in capsys.readouterr().err
    (folder / "pos.txt").write_text("the cat sat\nthe theory\n")
    (folder / "neg.txt").write_text("the mat sat\nthe thing\n")
    assert cli.main(["steer", "train", "--positive", str(folder / "pos.txt"), "--negative", str(folder / "neg.txt"),
                     "--layers", "1", "--site", "attn_heads", "--method", "mean_diff", "-o", str(folder / "h.gguf"),
                     "--model", model]) == 0
    vec = kw.ControlVector.load(folder / "h.gguf")
    assert vec.site == "attn_heads" and vec.width == lm.backbone.layers[1].self_attn.site_width("attn_heads")
