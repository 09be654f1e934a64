"""bench/devices.py, the accelerator bench, checked on the CPU with its 2-layer configurations; its
preset architectures checked against the presets' own GGUF metadata."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import devices  # noqa: E402

TINY_RUN = ["--device", "cpu", "--tiny", "--models", "smollm2-135m-instruct", "--new-tokens", "4", "--prefill", "16",
            "--batch", "1", "2", "--steer-rows", "2", "--modes", "eager"]


def records(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_every_measurement_is_written_as_it_comes(tmp_path, capsys):
    assert devices.main([*TINY_RUN, "--out", str(tmp_path)]) == 0
    got = {r["what"]: r for r in records(tmp_path)}
    for what in ("kvwire eager decode b1", "kvwire eager decode b2", "kvwire eager prefill 16",
                 "kvwire eager decode b2, 2 distinct strengths",
                 "transformers (static cache, eager on this device) decode b1",
                 "transformers (static cache, eager on this device) prefill 16"):
        assert got[what]["value"] > 0, what
    cost = got["kvwire eager steering cost at b2"]
    assert cost["unit"] == "%" and -100 < cost["value"] < 100
    # the CPU standing in for the device: the same greedy tokens, all 4 x 32 of them
    assert got["greedy tokens equal to the CPU's (float32, 4 prompts)"]["value"] == 128
    ratio = got["smollm2-135m-instruct: kvwire best / transformers, decode b2"]["value"]
    assert ratio == pytest.approx(got["kvwire eager decode b2"]["value"]
                                  / got["transformers (static cache, eager on this device) decode b2"]["value"])
    assert "kvwire eager decode b1" in capsys.readouterr().out


def test_a_spent_budget_skips_and_says_so(tmp_path):
    assert devices.main([*TINY_RUN, "--budget", "0", "--out", str(tmp_path)]) == 0
    measured = [r for r in records(tmp_path) if r["value"] is not None]
    assert measured == []
    notes = [r["note"] for r in records(tmp_path) if r["what"] != "device"]
    assert notes and all(n == "skipped: past the 0 s budget" for n in notes)


@pytest.mark.parametrize("argv, message", [(["--new-tokens", "1"], "--new-tokens must be at least 2"),
                                           (["--batch", "0"], "--batch must be >= 1")])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        devices.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", list(devices.CONFIGS))
def test_the_random_architectures_are_the_presets(name):
    """Each configuration the bench builds matches its preset's GGUF metadata (where installed; read
    with kvwire's header parser: gguf's reader takes ~20 s over Gemma 3's 262,144-token vocabulary)."""
    from kvwire.io.gguf import GGUFFile
    from kvwire.load import PRESETS

    try:
        path = PRESETS[name]()
    except ValueError as e:
        pytest.skip(str(e))
    fields = GGUFFile(path).metadata
    arch = fields["general.architecture"]

    def meta(key):
        return fields[f"{arch}.{key}"]

    _, c = devices.CONFIGS[name]
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == \
        (meta("block_count"), meta("embedding_length"), meta("feed_forward_length"))
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == \
        (meta("attention.head_count"), meta("attention.head_count_kv"))
    assert c["max_position_embeddings"] == meta("context_length")
    assert c["rms_norm_eps"] == pytest.approx(meta("attention.layer_norm_rms_epsilon"), rel=1e-5)
    assert c["vocab_size"] == len(fields["tokenizer.ggml.tokens"])
    head_dim = meta("attention.key_length") if f"{arch}.attention.key_length" in fields else \
        meta("embedding_length") // meta("attention.head_count")
    assert c["head_dim"] == head_dim
    if f"{arch}.attention.sliding_window" in fields:
        assert c["sliding_window"] == meta("attention.sliding_window")
    if "rope_theta" in c:
        assert c["rope_theta"] == meta("rope.freq_base")


def test_the_gpu_script_runs_the_tests_and_writes_its_files(tmp_path):
    """bench/gpu/run.sh on a machine without the device: the accelerator tests skip (the device-agnostic
    ones run: here only those refusing a device, the rest run in this suite already), the bench
    refuses the device, and every file is written."""
    import os
    import subprocess

    script = Path(__file__).resolve().parent.parent / "bench" / "gpu" / "run.sh"
    env = {**os.environ, "PYTHON": sys.executable, "KVWIRE_TEST_DEVICE": "cuda:9",
           "KVWIRE_WHEELS": str(tmp_path / "no-wheels"), "PYTEST_ADDOPTS": "-k 'cuda or refuse'"}
    done = subprocess.run(["bash", str(script), str(tmp_path), "160"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    env_txt = (tmp_path / "env.txt").read_text()
    assert "available" in env_txt and "gguf " in env_txt and "kvwire 0.1" in env_txt
    assert (tmp_path / "info.txt").read_text().startswith("kvwire ")
    tests = (tmp_path / "tests.txt").read_text()
    assert " passed" in tests and "SKIPPED" in tests and "device 'cuda:9' is not usable here" in tests
    bench = (tmp_path / "bench.txt").read_text()  # the device refused, or no budget left for the bench
    assert "device 'cuda:9' is not usable here" in bench or "no time left in the 160 s budget" in bench


def test_a_failing_measurement_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("no graph for you")

    monkeypatch.setattr(devices, "transformers_calls", broken)
    assert devices.main([*TINY_RUN, "--steer-rows", "0", "--out", str(tmp_path)]) == 0
    got = {r["what"]: r for r in records(tmp_path)}
    assert got["transformers"]["note"] == "failed: RuntimeError: no graph for you"
    assert got["kvwire eager decode b1"]["value"] > 0 and got["greedy tokens equal to the CPU's (float32, 4 prompts)"]
