"""POST /kvwire/capture and /kvwire/patch over httpx (tiny chat model): the answers equal `lm.capture`
and `kw.patch.sweep`; base64 and JSON lists carry the same floats; size limits and bad input are 400s
naming what was sent; `analysis=False` answers 403, behind the API keys like every endpoint."""
import base64
import threading

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvwire as kw  # noqa: E402
from kvwire.serve import create_app  # noqa: E402
from kvwire.serve.analysis import AnalysisLimits  # noqa: E402

from .serve_fixtures import Server, tiny_chat_lm  # noqa: E402

LIMITS = AnalysisLimits(capture_values=4096, patch_rows=20)


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def api(lm):
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=64, analysis_limits=LIMITS))
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.close()


def _array(entry):
    return np.frombuffer(base64.b64decode(entry["data"]), dtype="<f4").reshape(entry["shape"])


def test_capture_equals_lm_capture_in_base64_and_in_lists(api, lm):
    body = {"input": ["ab cat", "dog"], "sites": ["attn_heads", "block_out"], "layers": [1, 3]}
    got = api.post("/kvwire/capture", json=body)
    assert got.status_code == 200, got.text
    listed = api.post("/kvwire/capture", json={**body, "encoding_format": "float"}).json()
    ref = lm.capture(["ab cat", "dog"], sites=["attn_heads", "block_out"], layers=[1, 3])
    data = got.json()["data"]
    assert [row["tokens"] for row in data] == [lm.encode("ab cat"), lm.encode("dog")]
    for i, row in enumerate(data):
        assert [(e["site"], e["layer"]) for e in row["activations"]] == list(ref.keys())
        for entry, as_list in zip(row["activations"], listed["data"][i]["activations"]):
            expected = ref.row(i)[(entry["site"], entry["layer"])].numpy()
            assert entry["shape"] == list(expected.shape) == [len(row["tokens"]), 32]
            np.testing.assert_array_equal(_array(entry), expected)
            np.testing.assert_array_equal(np.array(as_list["data"], dtype=np.float32), expected)


def test_patch_equals_the_python_sweep(api, lm):
    body = {"clean": "ab cat", "corrupted": "ab dog", "answers": ["c", "d"], "sites": ["block_out", "mlp_out"],
            "layers": "2-3", "positions": [-1, 3]}
    got = api.post("/kvwire/patch", json=body)
    assert got.status_code == 200, got.text
    ref = kw.patch.sweep(lm, "ab cat", "ab dog", ["block_out", "mlp_out"], [-1, 3], layers="2-3", answers=("c", "d"))
    answer = got.json()
    assert answer["object"] == "kvwire.patch" and answer["positions"] == [5, 3] and answer["layers"] == [2, 3]
    np.testing.assert_allclose(answer["logit_diff"], ref.scores.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(answer["recovered"], ref.recovered.numpy(), rtol=0, atol=1e-6)
    mapped = api.post("/kvwire/patch", json={**body, "clean": "ab cats", "position_map": {"0": 0, "5": 6, "3": 3}})
    assert mapped.status_code == 200 and mapped.json()["positions"] == [5, 3], mapped.text


def test_limits_and_bad_input_are_400s_naming_them(api):
    big = api.post("/kvwire/capture", json={"input": ["abcdefgh"] * 4, "sites": ["block_out", "mlp_out"]})
    assert big.status_code == 400
    assert big.json()["error"]["message"] == ("this capture holds 8192 values (4 prompts x 8 tokens x 256 across 8 "
                                              "(site, layer) pairs); this server gives at most 4096 "
                                              "(--max-capture-values)")
    rows = api.post("/kvwire/patch", json={"clean": "ab cat", "corrupted": "ab dog", "answers": ["c", "d"]})
    assert rows.status_code == 400 and "patches 24 rows (1 sites x 4 layers x 6 positions); this server runs at " \
                                      "most 20 (--max-patch-rows)" in rows.json()["error"]["message"]
    site = api.post("/kvwire/capture", json={"input": "ab", "sites": "resid_post"})
    assert site.status_code == 400 and "sites ['resid_post'] are not sites" in site.json()["error"]["message"]
    lengths = api.post("/kvwire/patch", json={"clean": "ab cats", "corrupted": "ab dog", "answers": ["c", "d"]})
    assert lengths.status_code == 400
    assert "the clean prompt has 7 tokens and the corrupted one 6" in lengths.json()["error"]["message"]
    answers = api.post("/kvwire/patch", json={"clean": "ab cat", "corrupted": "ab dog", "answers": ["c"]})
    assert answers.status_code == 400 and answers.json()["error"]["param"] == "answers"
    shape = api.post("/kvwire/capture", json={"input": "ab", "encoding_format": "bytes"})
    assert shape.status_code == 400 and shape.json()["error"]["param"] == "encoding_format"


def test_capture_beside_generation_leaves_both_right(api, lm):
    expected = lm.generate("ab cat", max_new_tokens=12)
    done = {}

    def complete():
        done["text"] = api.post("/v1/completions", json={"model": "tiny", "prompt": "ab cat", "max_tokens": 12,
                                                         "temperature": 0}).json()["choices"][0]["text"]

    thread = threading.Thread(target=complete)
    thread.start()
    got = [api.post("/kvwire/capture", json={"input": "dog", "layers": [2]}).json() for _ in range(3)]
    thread.join(60)
    assert done["text"] == expected
    ref = lm.capture("dog", layers=[2])[("block_out", 2)][0].numpy()
    for answer in got:
        np.testing.assert_array_equal(_array(answer["data"][0]["activations"][0]), ref)


def test_turned_off_it_answers_403_behind_the_keys(lm):
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=64, analysis=False, api_keys=["sk-test"],
                               playground=False))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.post("/kvwire/capture", json={"input": "ab"}).status_code == 401
            key = {"Authorization": "Bearer sk-test"}
            for path in ("/kvwire/capture", "/kvwire/patch"):
                off = client.post(path, json={"input": "ab"}, headers=key)
                assert off.status_code == 403
                assert off.json()["error"]["message"].endswith("(started with --no-analysis)")
    finally:
        server.close()


def test_the_serve_command_reads_the_analysis_flags(capsys):
    from kvwire.cli import parser
    from kvwire.cli.serve import _analysis_limits

    plain = parser().parse_args(["serve"])
    assert plain.analysis is True and _analysis_limits(plain) == AnalysisLimits()
    args = parser().parse_args(["serve", "--no-analysis", "--max-capture-values", "4096", "--max-patch-rows", "20"])
    assert args.analysis is False and _analysis_limits(args) == LIMITS
    evals = parser().parse_args(["serve", "--max-eval-strengths", "3", "--max-eval-examples", "7",
                                 "--max-eval-neutral-tokens", "64"])
    assert _analysis_limits(evals) == AnalysisLimits(eval_strengths=3, eval_examples=7, eval_neutral_tokens=64)
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--max-patch-rows", "0"])
    assert "--max-patch-rows: expected a positive int, got '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--max-capture-values must be a positive int, got 0"):
        AnalysisLimits(capture_values=0)
