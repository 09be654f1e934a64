"""POST /kvwire/evaluate over httpx (tiny chat model): the answer equals `kw.steer.evaluate` called on
the same model, for a served vector on the shipped dataset and for inline vectors (base64 and
lists) on examples in the body; each bound and each bad field is a 4xx naming it; `analysis=False`
answers 403."""
import base64

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvwire as kw  # noqa: E402
from kvwire.serve import create_app  # noqa: E402
from kvwire.serve.analysis import AnalysisLimits  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

LIMITS = AnalysisLimits(eval_strengths=4, eval_examples=3, eval_neutral_tokens=64)
EXAMPLES = [{"prompt": "I feel", "positive": " good", "negative": " bad"},
            {"prompt": "The day was", "positive": " fine", "negative": " awful"},
            {"prompt": "ab cat", "positive": " yes", "negative": " no"}]
NEUTRAL = "The river runs past the mill and on to the sea."
# every list of numbers `Evaluation.to_dict()` holds, and its scalars
LISTS = ("strengths", "logit_diff", "per_example", "slopes", "kl", "perplexity", "ppl_increase")
SCALARS = ("slope_mean", "slope_std", "anti_steerable", "base_perplexity")


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def api(lm):
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=64, control_vectors=control_vectors(lm),
                               analysis_limits=LIMITS, playground=False))
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client
    server.close()


def evaluate(api, **body):
    got = api.post("/kvwire/evaluate", json=body)
    assert got.status_code == 200, got.text
    return got.json()


def same(answer, result):
    """The endpoint's answer holds `result.to_dict()` (to float rounding of the same computation)."""
    expected = result.to_dict()
    assert answer["object"] == "kvwire.evaluation" and answer["model"] == "tiny"
    assert {k: answer[k] for k in ("operation", "dataset", "neutral_tokens")} == \
        {k: expected[k] for k in ("operation", "dataset", "neutral_tokens")}
    for key in LISTS + SCALARS:
        np.testing.assert_allclose(answer[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_served_vector_on_the_shipped_dataset_equals_evaluate(lm):
    # the shipped set has 30 examples: a server that takes them
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=256, control_vectors=control_vectors(lm),
                               playground=False))
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            answer = evaluate(client, vector="happy", strengths=[-2, 0, 2.5], neutral=NEUTRAL, neutral_tokens=16)
    finally:
        server.close()
    result = kw.steer.evaluate(lm, control_vectors(lm)["happy"], "sentiment-ab", [-2, 0, 2.5], neutral=NEUTRAL,
                               neutral_tokens=16)
    same(answer, result)
    assert answer["vector"] == "happy" and answer["dataset"] == "sentiment-ab"
    assert len(answer["per_example"]) == 30 and len(answer["logit_diff"]) == 3
    assert answer["kl"][1] == pytest.approx(0.0, abs=1e-6) and answer["kl"][0] > 1e-4  # it does steer


def test_inline_vectors_on_examples_equal_evaluate(api, lm):
    width = lm.head.weight.shape[1]
    g = torch.Generator().manual_seed(1)
    d1, d3 = torch.randn(width, generator=g), torch.randn(width, generator=g)
    packed = base64.b64encode(d1.numpy().astype("<f4").tobytes()).decode()
    data = kw.steer.ABDataset.from_records(EXAMPLES, "examples", "examples")
    for operation, strengths in (("add", [-3, 0, 3]), ("clamp", [-1, 1]), ("ablate", [0, 0.5, 1])):
        vector = {"directions": {"1": packed, "3": d3.tolist()}, "operation": operation, "site": "block_out"}
        answer = evaluate(api, vector=vector, strengths=strengths, examples=EXAMPLES, neutral=[NEUTRAL, NEUTRAL[:15]],
                          neutral_tokens=20)
        expected = kw.steer.evaluate(lm, kw.ControlVector({1: d1, 3: d3}, operation=operation), data, strengths,
                                     neutral=[NEUTRAL, NEUTRAL[:15]], neutral_tokens=20)
        same(answer, expected)
        assert answer["vector"] is None and answer["dataset"] == "examples" and len(answer["per_example"]) == 3
    answer = evaluate(api, vector=vector, strengths=[0, 0.5, 1], examples=EXAMPLES, neutral=NEUTRAL, neutral_tokens=20,
                      generated_only=True)  # the answers alone: the library's when="generated"
    operation = kw.steer.Operation.of(kw.ControlVector({1: d1, 3: d3}, operation="ablate"), when="generated")
    same(answer, kw.steer.evaluate(lm, operation, data, [0, 0.5, 1], neutral=NEUTRAL, neutral_tokens=20))
    assert answer["operation"].endswith("generated positions")


def test_a_vector_at_another_site(api, lm):
    width = lm.head.weight.shape[1]
    direction = torch.linspace(-1, 1, width)
    answer = evaluate(api, vector={"directions": {"2": direction.tolist()}, "site": "mlp_out"}, strengths=[0, 4],
                      examples=EXAMPLES[:2], neutral=NEUTRAL, neutral_tokens=24)
    expected = kw.steer.evaluate(lm, kw.ControlVector({2: direction}, site="mlp_out"),
                                 kw.steer.ABDataset.from_records(EXAMPLES[:2], "examples", "examples"), [0, 4],
                                 neutral=NEUTRAL, neutral_tokens=24)
    same(answer, expected)
    assert "mlp_out" in answer["operation"]


def refused(api, body, status, param, message):
    got = api.post("/kvwire/evaluate", json={"vector": "happy", "strengths": [0, 1], "examples": EXAMPLES[:1],
                                             "neutral": NEUTRAL, "neutral_tokens": 16, **body})
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert error["param"] == param and message in error["message"], error
    return error


def test_each_bound_is_a_400_naming_it(api):
    refused(api, {"strengths": [0, 1, 2, 3, 4]}, 400, "strengths",
            "strengths has 5 strengths; this server evaluates at most 4 (--max-eval-strengths)")
    refused(api, {"examples": EXAMPLES + EXAMPLES[:1]}, 400, "examples",
            "examples has 4 examples; this server evaluates at most 3 (--max-eval-examples)")
    refused(api, {"examples": None}, 400, "dataset", "dataset has 30 examples; this server evaluates at most 3")
    refused(api, {"neutral": NEUTRAL * 2}, 400, "neutral",
            "neutral has 94 tokens; this server evaluates at most 64 (--max-eval-neutral-tokens)")
    refused(api, {"neutral_tokens": 65}, 400, "neutral_tokens",
            "neutral_tokens is 65; expected 2 to 64 tokens per neutral row")
    refused(api, {"neutral_tokens": 1}, 400, "neutral_tokens", "neutral_tokens is 1; expected 2 to 64")


def test_bad_fields_are_4xx_naming_them(api, lm):
    width = lm.head.weight.shape[1]
    refused(api, {"vector": "sad"}, 404, "vector", "no control vector named 'sad'; loaded: happy, formal")
    refused(api, {"strengths": [1, 1.0]}, 400, "strengths", "at least two different numbers (a slope needs two)")
    refused(api, {"strengths": ["1", 2]}, 400, "strengths.0", "input should be a number, got '1'")
    inline = {"directions": {"1": [0.5] * width}}
    refused(api, {"vector": {**inline, "operation": "scale"}}, 400, "vector",
            "vector.operation is 'scale'; expected one of ['add', 'ablate', 'clamp']")
    refused(api, {"vector": {**inline, "site": "resid_post"}}, 400, "vector", "vector.site is 'resid_post'")
    refused(api, {"vector": {"directions": {"9": [0.5] * width}}}, 400, "vector",
            "vector.directions has block '9'; the model's blocks are 0 to 3")
    refused(api, {"vector": {"directions": {}}}, 400, "vector", "vector.directions is empty")
    refused(api, {"vector": {"directions": {"1": [0.5] * 3}}}, 400, "vector",
            f"vector.directions.1 has 3 numbers; expected {width} (the model's width)")
    refused(api, {"vector": {"directions": {"1": "AAAA"}}}, 400, "vector",
            f"vector.directions.1 decodes to 3 bytes; expected {4 * width} ({width} little-endian float32)")
    refused(api, {"vector": {"directions": {"1": "not base64!"}}}, 400, "vector",
            "vector.directions.1 is not valid base64")
    refused(api, {"vector": {"directions": {"1": [1e39] + [0.5] * (width - 1)}}}, 400, "vector",
            "vector.directions.1 holds NaN, infinite or past-float32 values")
    nan = base64.b64encode(np.full(width, np.nan, dtype="<f4").tobytes()).decode()
    refused(api, {"vector": {"directions": {"1": nan}}}, 400, "vector", "vector.directions.1 holds NaN")
    refused(api, {"vector": {"directions": {"1": [0.0] * width}, "operation": "ablate"}}, 400, "vector",
            "vector.directions.1 is all zeros: it has no direction to ablate")
    refused(api, {"vector": {**inline, "strength": 2}}, 400, "vector",
            "vector: the inline vector's strength: extra inputs are not permitted, got an object")
    refused(api, {"vector": {"operation": "add"}}, 400, "vector", "the inline vector's directions: field required")
    refused(api, {"dataset": "sentiment-ab"}, 400, "dataset",
            "give dataset or examples, not both; got dataset 'sentiment-ab' and 1 examples")
    refused(api, {"examples": None, "dataset": "/etc/passwd"}, 400, "dataset",
            "dataset '/etc/passwd' is not a shipped dataset; expected one of ['sentiment-ab']")
    refused(api, {"examples": [{"prompt": "I", "positive": " a", "negative": " a"}]}, 400, "examples",
            "examples line 1: the two answers are the same (' a'); they must differ")
    refused(api, {"examples": [{"prompt": "I", "positive": " a"}]}, 400, "examples.0.negative",
            "examples.0.negative is required")
    refused(api, {"examples": [{"prompt": "x" * 300, "positive": " a", "negative": " b"}]}, 400, "examples",
            "examples line 1's prompt and answer")
    refused(api, {"neutral": ""}, 400, "neutral", "neutral must be a text or a list of texts, none blank, got ''")
    refused(api, {"neutral": ["ab", " "]}, 400, "neutral", "none blank, got ['ab', ' ']")


def test_limits_are_checked_when_made():
    with pytest.raises(ValueError, match="--max-eval-strengths must be a positive int, got 0"):
        AnalysisLimits(eval_strengths=0)
    with pytest.raises(ValueError, match="--max-eval-neutral-tokens must be a positive int, got True"):
        AnalysisLimits(eval_neutral_tokens=True)


def test_turned_off_it_answers_403(lm):
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=64, analysis=False, playground=False,
                               control_vectors=control_vectors(lm)))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            off = client.post("/kvwire/evaluate", json={"vector": "happy", "strengths": [0, 1]})
            assert off.status_code == 403
            assert off.json()["error"]["code"] == "analysis_disabled"
            assert "evaluate vectors (started with --no-analysis)" in off.json()["error"]["message"]
    finally:
        server.close()
