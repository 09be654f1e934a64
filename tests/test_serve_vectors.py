"""The server's named control vectors (`kvwire.serve.vectors`): names the inline-vector and SAE banks
use for their runtime inputs are refused up front (training, start-up), names that only resemble
them are served beside both banks. Tiny chat model over uvicorn."""
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402
from .test_sae import random_sae, write_sae  # noqa: E402

PAIRS = dict(positive=["I am so happy today", "What a wonderful surprise"],
             negative=["I am so sad today", "What a terrible surprise"])
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
RESERVED = "is reserved: 'inline' and 'sae', alone or followed by a slot number (inline0, sae12), name the runtime"


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    sae = write_sae(tmp_path_factory.mktemp("sae") / "blocks.1", random_sae(jumprelu=True))
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=128, inline_slots=2, sae=str(sae), sae_slots=4))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("name", ["sae", "sae0", "sae3", "sae12", "inline", "inline0", "inline1", "inline7"])
def test_training_a_vector_named_as_a_bank_is_refused_up_front(api, server, name):
    answer = api.post("/kvwire/train", json={"name": name, **PAIRS, "layers": "1"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "name" and error["code"] == "invalid_value"
    assert error["message"].startswith(f"control vector name {name!r} {RESERVED}")
    assert server.app.state.bridge.swaps == 0 and name not in server.app.state.served.vectors


def test_names_that_only_resemble_a_bank_are_served_beside_both_banks(api, server):
    served = server.app.state.served
    for name in ("inline00", "inline_x", "inlines", "sae01", "saex", "my_sae"):  # no input of theirs collides
        served.check_new_name(name)
    job = api.post("/kvwire/train", json={"name": "sae_style", **PAIRS, "layers": "1", "method": "mean_diff"}).json()
    deadline = time.monotonic() + 120
    while job["state"] not in ("done", "error"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = api.get(f"/kvwire/jobs/{job['id']}").json()
    assert job["state"] == "done", job
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True}
    steered = [api.post("/v1/chat/completions", json={**body, **extra}) for extra in
               ({}, {"steer": {"sae_style": 4.0}}, {"sae_features": {"5": 6.0}})]
    assert [a.status_code for a in steered] == [200, 200, 200], [a.text for a in steered]
    logprobs = [[e["logprob"] for e in a.json()["choices"][0]["logprobs"]["content"]] for a in steered]
    assert logprobs[1] != pytest.approx(logprobs[0], abs=1e-3) and logprobs[2] != pytest.approx(logprobs[0], abs=1e-3)


@pytest.mark.parametrize("slots", [0, 2])
def test_a_server_refuses_a_reserved_name_at_start(lm, slots):
    vectors = {"inline0": control_vectors(lm)["happy"]}
    with pytest.raises(ValueError, match=re.escape(f"control vector name 'inline0' {RESERVED}")):
        create_app(lm, "tiny", max_batch=2, max_length=64, control_vectors=vectors, inline_slots=slots)
