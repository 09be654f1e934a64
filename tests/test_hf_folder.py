"""Hugging Face checkpoint folders (config.json, single or sharded safetensors, tokenizer.json),
and the `kvwire generate` command on one."""
import pytest
import torch

import kvwire as kw
from kvwire import cli

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2


def _tokenizer_json(folder, vocab_size):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    corpus = ["the cat sat on the mat", "the theory of the thing", "a tiny tokenizer for tests"] * 20
    tok.train_from_iterator(corpus, vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.fixture(params=["single", "sharded"])
def gpt2_folder(tmp_path, request):
    hf = tiny_hf_gpt2(vocab_size=300, bos_token_id=0, eos_token_id=0)
    shard = "20KB" if request.param == "sharded" else "1GB"
    hf.save_pretrained(tmp_path, max_shard_size=shard)
    _tokenizer_json(tmp_path, 300)
    return tmp_path, hf


def test_gpt2_folder_matches_transformers(gpt2_folder):
    folder, hf = gpt2_folder
    if "sharded" in str(folder):
        assert (folder / "model.safetensors.index.json").is_file()
    lm = kw.load(folder)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=2e-5, rtol=0)
    assert lm.tokenizer.decode(lm.tokenizer.encode("the cat sat")) == "the cat sat"


def test_gemma3_folder_matches_transformers(tmp_path):
    hf = tiny_hf_gemma3()
    hf.save_pretrained(tmp_path)
    lm = kw.load(tmp_path)
    assert lm.tokenizer is None
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=2e-5, rtol=0)


def test_generate_command(gpt2_folder, capsys):
    folder, hf = gpt2_folder
    assert cli.main(["generate", "the cat", "--model", str(folder), "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    lm = kw.load(folder)
    assert out.strip() == "the cat" + lm.generate("the cat", max_new_tokens=5)
    assert "prefill" in err and "tokens/s" in err


def test_generate_command_reports_bad_input(capsys):
    assert cli.main(["generate", "hi", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_bfloat16_load_generates_like_float32_on_a_tiny_model(gpt2_folder):
    folder, _ = gpt2_folder
    lm16, lm32 = kw.load(folder, dtype="bfloat16"), kw.load(folder)
    assert lm16.head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lm16(ids).float(), lm32(ids), atol=0.5, rtol=0.05)
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        kw.load(folder, dtype="int8")


def test_generate_command_options_and_score(gpt2_folder, tmp_path, capsys):
    folder, _ = gpt2_folder
    args = ["generate", "the cat", "--model", str(folder), "--max-new-tokens", "8", "--top-k", "5", "--seed", "3"]
    assert cli.main(args) == 0 and cli.main(args) == 0
    first, second = capsys.readouterr().out.strip().split("\n")
    assert first == second  # seeded
    assert cli.main(["generate", "the cat", "--model", str(folder), "--beams", "2", "--max-new-tokens", "4"]) == 0
    assert "prefill" in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat")
    assert cli.main(["score", str(text), "--model", str(folder)]) == 0
    lm = kw.load(folder)
    assert f"perplexity {lm.perplexity('the cat sat on the mat'):.3f}" in capsys.readouterr().out
    assert cli.main(["generate", "x", "--model", str(folder), "--top-p", "2"]) == 2
    assert "top_p must lie in (0, 1], got 2.0" in capsys.readouterr().err


def test_cli_sampler_choice():
    parse = cli.parser().parse_args
    assert cli.make_sampler(parse(["generate", "p"])) == kw.Greedy()
    assert cli.make_sampler(parse(["generate", "p", "--top-p", "0.8", "--temperature", "0.7"])) == kw.TopP(0.8, 0.7)
    assert cli.make_sampler(parse(["generate", "p", "--beams", "4"])) == kw.BeamSearch(num_beams=4)
    assert cli.make_sampler(parse(["generate", "p", "--sampler", "min-p"])) == kw.MinP(0.1)


@pytest.mark.parametrize("edit, message", [
    (lambda f: _set_config(f, n_embd="32"), r"config.json: GPT2Config: n_embd='32' \(str\); expected an integer"),
    (lambda f: _set_config(f, n_head=5), "config.json: n_embd=32 is not a multiple of n_head=5"),
    (lambda f: _set_config(f, layer_norm_epsilon=float("nan")), "layer_norm_epsilon=nan .*expected a finite number"),
    (lambda f: _set_config(f, n_layer=10 ** 6), "n_layer=1000000; expected at most 512 layers"),
    (lambda f: (f / "config.json").write_text("{"), "config.json is not a readable JSON file"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:1000]),
     "model.safetensors is not a readable safetensors file"),
    (lambda f: _set_weight(f, "transformer.h.0.ln_1.weight", torch.full((32,), float("nan"))),
     r"tensor 'h.0.ln_1.weight' holds NaN or infinite values"),
    (lambda f: _set_weight(f, "transformer.h.0.ln_1.weight", torch.ones(32, dtype=torch.int32)),
     r"tensor 'h.0.ln_1.weight' has dtype torch.int32; expected floats"),
    (lambda f: _set_weight(f, "transformer.h.0.ln_1.weight", torch.ones(33)),
     r"tensor 'h.0.ln_1.weight' has shape \(33,\), expected \(32,\)"),
])
def test_a_corrupt_folder_is_a_clear_error_naming_the_file(tmp_path, edit, message):
    tiny_hf_gpt2().save_pretrained(tmp_path)
    edit(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}.*{message}"):
        kw.load(tmp_path)


def _set_config(folder, **values):
    import json

    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def _set_weight(folder, name, value):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, name: value}, str(folder / "model.safetensors"), metadata={"format": "pt"})
