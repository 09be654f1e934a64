"""One mistake, one error: the Python API (`lm.generate`), the engine (`Engine.submit`) and the HTTP
server check requests with the same code (`kvwire.generate.request`), so each mistake raises the
same type with the same message through every door (the server's 400 carries it, naming the field
as the request named it)."""
import math

import pytest
import torch

import kvwire as kw
from kvwire.generate.request import RequestError

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def served():
    lm = tiny_chat_lm()
    vectors = control_vectors(lm)
    app = create_app(lm, "tiny", max_batch=2, max_length=128, control_vectors=vectors)
    server = Server(app)
    steered = lm.steer(vectors["happy"], 0.0, name="happy").steer(vectors["formal"], 0.0, name="formal")
    yield steered, server
    server.close()


def _python(lm, **options):
    with pytest.raises(RequestError) as caught:
        lm.generate(PROMPT, **options)
    return caught.value


def _engine(lm, **options):
    engine = kw.Engine(lm, max_batch=1, max_length=64)
    options.setdefault("max_new_tokens", 4)
    with pytest.raises(RequestError) as caught:
        engine.submit(lm.encode(PROMPT), **options)
    return caught.value


def _http(server, **fields):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_bad_budget_is_one_message_through_every_door(served):
    lm, server = served
    python, engine = _python(lm, max_new_tokens=0), _engine(lm, max_new_tokens=0)
    http = _http(server, max_tokens=0)
    assert str(python) == str(engine) == "max_new_tokens must be an int >= 1, got 0"
    assert python.param == engine.param == "max_new_tokens"
    assert http["message"] == "max_tokens must be an int >= 1, got 0" and http["param"] == "max_tokens"
    assert http["code"] == python.code == "invalid_value"


def test_an_empty_stop_string_is_one_message_through_every_door(served):
    lm, server = served
    python, engine, http = _python(lm, stop=[""]), _engine(lm, stop_strings=[""]), _http(server, stop=[""])
    assert str(python) == str(engine) == http["message"] == "stop strings must be non-empty str, got ('',)"
    assert python.param == engine.param == http["param"] == "stop"


def test_a_seed_torch_cannot_take_is_one_message_through_every_door(served):
    lm, server = served
    seed = 2 ** 64
    python, engine, http = _python(lm, seed=seed), _engine(lm, seed=seed), _http(server, seed=seed)
    want = f"seed must be an int in [-2**63, 2**64), got {seed}"
    assert str(python) == str(engine) == http["message"] == want
    assert python.param == engine.param == http["param"] == "seed"


def test_a_strength_outside_float32_is_one_message_through_every_door(served):
    lm, server = served
    python = _python(lm, inputs={"happy_strength": torch.tensor([math.inf])})
    engine = _engine(lm, inputs={"happy_strength": math.inf})
    http = _http(server, steer={"happy": 1e39})
    assert str(python) == str(engine) == "happy_strength must be a finite float32 number, got inf"
    assert http["message"] == "steer.happy must be a finite float32 number, got 1e+39"
    assert http["param"] == "steer.happy"


def test_a_prompt_past_the_context_is_refused_before_anything_runs(served):
    lm, server = served
    long = "word " * 200  # 1000 byte tokens; the model's context is 256, the server's 128
    want = "the prompt has 1000 tokens, but the model's context is 256 tokens (prompt + new tokens)"
    with pytest.raises(RequestError) as python:
        lm.generate(long)
    with pytest.raises(RequestError) as engine:
        kw.Engine(lm, max_batch=1, max_length=64).submit(lm.encode(long), 4)
    assert str(python.value) == str(engine.value) and str(python.value).startswith(want)
    http = _http(server, prompt=long)
    assert http["message"].startswith("the prompt has 1000 tokens, but this server's context is 128 tokens")
    assert http["code"] == "context_length_exceeded" and http["param"] == "prompt"


def test_unknown_runtime_inputs_are_one_error_in_python_and_the_engine(served):
    lm, _ = served
    python = _python(lm, inputs={"sad_strength": torch.tensor([1.0])})
    engine = _engine(lm, inputs={"sad_strength": 1.0})
    assert str(python) == str(engine)
    assert str(python).startswith("unknown runtime inputs ['sad_strength']; this model takes ['formal_end', 'formal_start'")


def test_the_engine_refuses_what_its_steps_could_not_run(served):
    lm, _ = served
    engine = kw.Engine(lm, max_batch=1, max_length=64)
    ids = lm.encode(PROMPT)
    with pytest.raises(TypeError, match="sampler must be a kvwire sampler"):
        engine.submit(ids, 4, sampler="greedy")
    with pytest.raises(RequestError, match="beam search runs through generate"):
        engine.submit(ids, 4, sampler=kw.BeamSearch(num_beams=2))
    with pytest.raises(RequestError, match=r"stop token id 999 is outside the vocabulary \[0, 260\)"):
        engine.submit(ids, 4, stop_ids=[999])
    with pytest.raises(RequestError, match="top_logprobs must be an int >= 0, got -1"):
        engine.submit(ids, 4, top_logprobs=-1)
    assert engine.idle  # nothing was queued


def test_every_rows_seed_must_fit_and_the_message_quotes_the_callers_seed(served):
    lm, server = served
    top = 2 ** 64 - 1
    with pytest.raises(RequestError, match=rf"seed must be an int in \[-2\*\*63, 2\*\*64 - 1 .*got {top}$"):
        lm.generate([PROMPT, PROMPT], seed=top)
    assert isinstance(lm.generate(PROMPT, seed=top, max_new_tokens=2), str)  # one row: the top seed fits
    sample = dict(sampler=kw.Random(1.0), max_new_tokens=6)
    assert lm.generate(PROMPT, seed=7.0, **sample) == lm.generate(PROMPT, seed=7, **sample)  # an integral float
    http = _http(server, seed=top, n=2)
    assert http["param"] == "seed" and http["message"].endswith(f"got {top}")
