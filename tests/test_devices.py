"""Devices: `kw.load(device=...)`, `kw.from_hf(device=...)`, `lm.to(device)`, and generation that makes
every tensor on the model's device.

Without an accelerator, device-agnosticism is checked on the CPU in two ways: generation runs under
`torch.device("meta")` as the default device, so any tensor made without `device=` is a meta tensor
that fails loudly beside the CPU model's (and tokens must equal a plain run's); and `lm.to("meta")`
must move every parameter, buffer and kept cache. tests/test_cuda.py runs on an accelerator where one is.
"""
import sys
from pathlib import Path

import pytest
import torch

import kvwire as kw
from kvwire.graph.cache import CACHE_DTYPE
from kvwire.steer import Steer

from .conftest import tiny_hf_gemma3, tiny_hf_gpt2
from .tiny_models import tiny_hf
from .tokenizers_for_tests import char_level

# tokens of the char-level tokenizer: vocab 100 (98 ids used). llama: untied head; gpt2, gemma3 and
# qwen3 tie it; gemma2 has soft-caps and alternate sliding layers
MAKERS = {
    "gpt2": lambda **o: tiny_hf_gpt2(vocab_size=100, **o),
    "gemma3": lambda **o: tiny_hf_gemma3(vocab_size=100, **o),
    "llama": lambda **o: tiny_hf("llama", vocab_size=100, **o),
    "qwen3": lambda **o: tiny_hf("qwen3", vocab_size=100, **o),
    "gemma2": lambda **o: tiny_hf("gemma2", vocab_size=100, **o),
}
FAMILIES = list(MAKERS)
PROMPTS = ["Hello there", "A"]


def tiny_lm(family, num_hidden_layers=None, **options):
    hf = MAKERS[family]() if num_hidden_layers is None else MAKERS[family](num_hidden_layers=num_hidden_layers)
    lm = kw.from_hf(hf, **options)
    lm.tokenizer = char_level()
    return lm


def _train(lm):
    return kw.ControlVector.train(lm, ["I am happy", "so glad"], ["I am sad", "so down"], progress=False)


# ---- kw.load / kw.from_hf -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = tiny_hf("llama")
    hf.save_pretrained(folder)
    return folder, hf


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0"])
def test_load_and_from_hf_put_the_weights_on_the_device(llama_folder, device):
    folder, hf = llama_folder
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
    for lm in (kw.load(folder, device=device), kw.from_hf(hf, device=device)):
        assert lm.device == torch.device("cpu")
        assert {t.device.type for t in [*lm.parameters(), *lm.buffers()]} == {"cpu"}
        with torch.no_grad():
            torch.testing.assert_close(lm(ids), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("device, error, message", [
    ("gpu", ValueError, r"unknown device 'gpu'; expected a torch device such as 'cpu', 'cuda'"),
    ("cpu0", ValueError, r"unknown device 'cpu0'"),
    (2.5, TypeError, r"device must be a torch.device or its name \('cpu', 'cuda:0'\), got float"),
    (True, TypeError, r"device must be a torch.device or its name"),
])
def test_a_bad_device_is_a_clear_error(llama_folder, device, error, message):
    folder, hf = llama_folder
    with pytest.raises(error, match=message):
        kw.load(folder, device=device)
    with pytest.raises(error, match=message):
        kw.from_hf(hf, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_an_unavailable_device_is_refused_before_loading(llama_folder):
    folder, hf = llama_folder
    with pytest.raises(ValueError, match=r"device 'cuda' is not usable here: .*CUDA"):
        kw.load("no/such/model", device="cuda")  # refused before the name is even looked at
    with pytest.raises(ValueError, match=r"device 'cuda:0' is not usable here"):
        kw.from_hf(hf, device="cuda:0")


@pytest.mark.parametrize("argv, message", [
    (["generate", "Hi", "--device", "gpu"], "unknown device 'gpu'"),
    (["serve", "--device", "gpu"], "unknown device 'gpu'"),
    (["generate", "Hi", "--device", "cuda", "--runtime", "onnx"], "--device cuda applies to eager models"),
])
def test_the_cli_refuses_a_bad_device_before_loading(argv, message, capsys):
    from kvwire import cli

    assert cli.main([*argv, "--model", "/no/such/model"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("command", [["generate", "Hi"], ["serve"]])
def test_the_cli_refuses_an_unavailable_device_before_loading(command, capsys):
    from kvwire import cli

    assert cli.main([*command, "--device", "cuda", "--model", "/no/such/model"]) == 2
    assert "device 'cuda' is not usable here" in capsys.readouterr().err


@pytest.mark.parametrize("quantize, kernels", [("int4", "PyTorch's CPU int8/int4 kernels"),
                                               ("int8", "PyTorch's CPU int8/int4 kernels"),
                                               ("q8_0", "ggml's CPU kernels"), ("gguf", "ggml's CPU kernels")])
def test_cpu_only_quantisation_refuses_another_device(llama_folder, quantize, kernels):
    folder, _ = llama_folder
    with pytest.raises(ValueError, match=rf"quantize='{quantize}' runs on {kernels}, which device='meta' "
                                         rf"cannot run; load with quantize=None on 'meta'"):
        kw.load(folder, quantize=quantize, device="meta")


def test_a_quantised_model_refuses_to_move_and_stays_whole():
    lm = kw.quantize(tiny_lm("llama"), "int8")
    with pytest.raises(ValueError, match=r"cannot move this model to meta: it holds \d+ quantised layers "
                                         r"\(int8/int4 \(PyTorch's CPU kernels\), e.g. 'backbone\..*'\) "
                                         r"that run on the CPU only"):
        lm.to("meta")
    assert {t.device.type for t in [*lm.parameters(), *lm.buffers()]} == {"cpu"}  # nothing moved
    assert lm.to(torch.bfloat16) is lm  # a cast on the CPU is fine


# ---- every tensor on the model's device: generation under a meta default device -------------------

def _generation_surface(lm, strength):
    """Greedy (ragged ids and text), seeded sampling with a repetition penalty, beam search,
    steering (a per-row strength, generated tokens only), stop ids, log-probabilities and scoring."""
    ids = [torch.tensor(lm.tokenizer.encode(p), device="cpu") for p in PROMPTS]
    vec = _train(lm)
    steered = lm.steer(vec, strength, generated_only=True)
    record = lm.generate(PROMPTS, max_new_tokens=6, sampler=kw.TopP(0.9), seed=3, repetition_penalty=1.3,
                         ignore_eos=True, return_logprobs=True)
    greedy = [t.tolist() for t in lm.generate(ids, max_new_tokens=8, ignore_eos=True)]
    return {
        "greedy ids": greedy,
        "greedy text": lm.generate(PROMPTS, max_new_tokens=8, ignore_eos=True),
        "stop ids": lm.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[greedy[0][2]]),
        "sampled": (record.tokens, record.logprobs),
        "top-k": lm.generate(PROMPTS, max_new_tokens=6, sampler=kw.TopK(5), seed=1, ignore_eos=True),
        "min-p": lm.generate(PROMPTS, max_new_tokens=6, sampler=kw.MinP(0.1), seed=2, ignore_eos=True),
        "beam": lm.generate(PROMPTS, max_new_tokens=6, sampler=kw.BeamSearch(3), repetition_penalty=1.2,
                            ignore_eos=True),
        "steered": steered.generate(PROMPTS, max_new_tokens=8, ignore_eos=True),
        "steered beam": steered.generate(PROMPTS, max_new_tokens=5, sampler=kw.BeamSearch(2), ignore_eos=True),
        "steer inputs": steered.generate(PROMPTS, max_new_tokens=4, ignore_eos=True,
                                         inputs={"steer_strength": strength * 2}),
        "stream": list(lm.stream("Hello", max_new_tokens=5, ignore_eos=True)),
        "vector": [v.tolist() for v in vec.directions.values()],
        "score": lm.score("Hello there").tolist(),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_makes_no_tensor_off_the_models_device(family):
    """Under torch.device("meta") every factory call without device= makes a meta tensor, which fails
    beside the CPU model's tensors: generation passing there made each tensor on the model's device."""
    lm = tiny_lm(family)
    strength = torch.tensor([30.0, 0.0])  # the caller's tensors are made outside the context
    expected = _generation_surface(lm, strength)
    lm.reset_caches()
    with torch.device("meta"):
        got = _generation_surface(lm, strength)
    assert got == expected
    # and the surface did something that could have differed
    (first, second), _ = expected["sampled"]
    assert first != second and len(expected["stop ids"][0]) < 3
    plain, steered = expected["greedy text"], expected["steered"]
    assert steered[0] != plain[0] and steered[1] == plain[1]  # row 0 steered, row 1 at strength 0


def _engine_surface(lm, vec):
    """An engine's schedule: rows joining a decoding batch (scratch prefills, per-row indices), per-row
    steering strengths and seeds, a prefix-store hit; then ablation and clamp ops through generate."""
    from kvwire.generate import Engine, PrefixStore

    steered = lm.steer(vec, 0.0)
    engine = Engine(steered, max_batch=2, max_length=48, prefill_chunk=4, prefix_store=PrefixStore(min_tokens=4))
    ids = [lm.tokenizer.encode(p) for p in ("Hello there, friend", "A cat", "Hi")]
    first = engine.submit(ids[0], 10, inputs={"steer_strength": 8.0})
    for i, _ in enumerate(engine.run([first])):
        if i == 2:
            break
    joined = engine.submit(ids[1], 6, sampler=kw.TopK(5), seed=4, inputs={"steer_strength": -8.0})
    list(engine.run([first, joined]))
    hit = engine.submit(ids[0] + first.tokens + ids[2], 5, inputs={"steer_strength": 8.0})
    list(engine.run([hit]))
    return {
        "engine": [first.tokens, joined.tokens, hit.tokens, hit.cached_tokens, engine.stats["scratch_prefills"]],
        "ablated": lm.ablate(vec).generate(PROMPTS, max_new_tokens=6, ignore_eos=True),
        "clamped": lm.clamp(vec, -1.0, 1.0).generate(PROMPTS, max_new_tokens=6, ignore_eos=True),
    }


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_engine_and_prefix_store_make_no_tensor_off_the_models_device(family):
    lm = tiny_lm(family)
    vec = _train(lm)
    expected = _engine_surface(lm, vec)
    lm.reset_caches()
    with torch.device("meta"):
        got = _engine_surface(lm, vec)
    assert got == expected
    first, _, _, cached, scratch = expected["engine"]
    assert cached > len(first) and scratch >= 1  # a prefix hit and a join while decoding happened


def test_a_long_prompt_makes_no_tensor_off_the_models_device():
    """64+ query rows per key/value head take the fused CPU attention kernel."""
    lm = tiny_lm("llama")
    prompt = "The quick brown fox jumps over the lazy dog, again and again, twice."
    expected = lm.generate(prompt, max_new_tokens=4, ignore_eos=True)
    with torch.device("meta"):
        assert lm.generate(prompt, max_new_tokens=4, ignore_eos=True) == expected


def test_inputs_on_another_device_are_a_clear_error():
    lm = tiny_lm("llama")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"token_ids are on meta but the model is on cpu; pass token_ids.to"):
        lm(ids.to("meta"))
    cache = lm.cached.init_cache(1, 8)
    mask = torch.ones(1, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask is on meta but token_ids is on cpu"):
        lm.cached(ids, torch.arange(3)[None], 0, mask.to("meta"), cache)
    with pytest.raises(ValueError, match=r"attention_mask is on cpu but cache of 'layers.0.self_attn' is on meta"):
        lm.cached(ids, torch.arange(3)[None], 0, mask, lm.cached.init_cache(1, 8, device="meta"))


# ---- lm.to(device) ------------------------------------------------------------------------------

def _tensors(lm):
    """Every tensor a model holds: parameters and buffers (the cached graph's included), the kept caches."""
    kept = lm.pool.tensors()
    return [*lm.parameters(), *lm.buffers(), *kept]


def _tied_name(lm):
    return next((n for n, p in lm.backbone.named_parameters() if p is lm.head.weight), None)


@pytest.fixture
def packed_float32_head(monkeypatch):
    """The head's float32 pack made from its first product (any CPU: the 'transposed' path), so a
    test can see it made and then dropped."""
    from kvwire.kernels import cpu

    monkeypatch.setenv("KVWIRE_F32_GEMV", "transposed")
    cpu.f32_gemv.cache_clear()
    yield lambda lm: setattr(lm.head.pack, "after", 1)
    cpu.f32_gemv.cache_clear()


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_to_meta_moves_every_parameter_buffer_and_cache(family, packed_float32_head):
    lm = tiny_lm(family)
    packed_float32_head(lm)
    tied = _tied_name(lm)
    # the head reads a backbone weight: llama's untied output matrix (backbone.lm_head), else the embedding
    assert tied.startswith("lm_head.") == (family == "llama")
    vec = _train(lm)
    assert {v.device.type for v in vec.directions.values()} == {"cpu"}
    steered = lm.steer(vec, 2.0)
    lm.generate("Hello", max_new_tokens=3)  # kept caches, the cached graph and the head's packed copy
    steered.generate("Hello", max_new_tokens=3)
    assert lm.pool.batch_sizes() and steered.pool.batch_sizes()
    if torch.backends.mkl.is_available():
        assert lm.head.pack.packed is not None  # made, so dropping it below is seen
    assert lm.to("meta") is lm and steered.to("meta") is steered
    for model in (lm, steered):
        assert model.device == torch.device("meta")
        assert {t.device.type for t in _tensors(model)} == {"meta"}
        assert all(t.dtype == CACHE_DTYPE for t in _tensors(model) if t.dim() == 4)
        assert model.head.pack.packed is None
        assert {t.device.type for t in model.cached.init_cache(2, 8)[0]} == {"meta"}
    # the head still reads the moved backbone weight (a clone holds only the modules its forward
    # calls, so the steered backbone has no lm_head: its head reads the original's)
    assert _tied_name(lm) == tied and steered.head.weight is lm.backbone.get_parameter(tied)
    assert _tied_name(steered) == (None if family == "llama" else tied)
    # steering a moved model puts the (CPU) vector and a CPU strength on the model's device
    for model in (steered, lm.steer(vec, torch.tensor([1.0, 2.0]), generated_only=True)):
        steers = [m for m in model.backbone.modules() if isinstance(m, Steer)]
        assert steers and all(m.direction.is_meta and m.strength.is_meta for m in steers)
        for lengths in (None, torch.tensor([3, 4], device="meta")):  # (torch.equal has no meta kernel)
            assert {v.device.type for v in steers[0].runtime_defaults(2, lengths).values()} == {"meta"}


def test_to_a_dtype_after_generating_equals_loading_in_that_dtype(packed_float32_head):
    """Kept caches stay float32 and the packed float32 head copy is dropped, so a cast model
    generates as one loaded in the dtype."""
    hf = MAKERS["llama"]()
    lm = kw.from_hf(hf)
    packed_float32_head(lm)
    lm.tokenizer = char_level()
    lm.generate(PROMPTS, max_new_tokens=4)
    lm.generate("Hello", max_new_tokens=4)
    if torch.backends.mkl.is_available():
        assert lm.head.pack.packed is not None  # made, so dropping it below is seen
    lm.to(torch.bfloat16)
    assert all(t.dtype == CACHE_DTYPE for t in _tensors(lm) if t.dim() == 4)
    assert lm.head.weight.dtype == torch.bfloat16 and lm.head.pack.packed is None
    fresh = kw.from_hf(hf, dtype="bfloat16")
    fresh.tokenizer = char_level()
    for prompt in (PROMPTS, "Hello"):
        assert lm.generate(prompt, max_new_tokens=6) == fresh.generate(prompt, max_new_tokens=6)


def test_the_device_bench_exits_clearly_without_the_device(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import devices

    assert devices.main(["--device", "gpu"]) == 2
    assert "bench/devices.py: unknown device 'gpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert devices.main(["--device", "cuda"]) == 2
        assert "device 'cuda' is not usable here" in capsys.readouterr().err
