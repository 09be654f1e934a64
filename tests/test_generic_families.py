"""The generic path on named transformers families kvwire has no native family for: MoE routers,
latent attention, sinks, chunked and sliding attention, ALiBi, parallel blocks, and the hybrids
with recurrent or state-space layers. Each type's tiny random model (`generic_configs.tiny_model`)
is built into a kvwire model once; transformers' uncached eager forward on a copy of the same
weights is the arbiter.

What does not work yet is marked `xfail(strict=True)` with the reason the run gives, so each mark
turns into a failure once support lands and is then removed."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import kvwire as kw

from .generic_configs import PROMPT_IDS, greedy_disagreements, hf_logits, prompt, rollout, tiny_model

transformers = pytest.importorskip("transformers")

NAMED = ["llama4_text", "gpt_oss", "mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v4", "smollm3",
         "gemma4_text", "cohere2", "falcon", "gpt_neox", "phi", "stablelm", "starcoder2", "bloom", "mpt", "opt",
         "qwen3_next", "qwen3_5_text", "lfm2", "olmo_hybrid", "granitemoehybrid", "falcon_h1", "zamba2", "mamba2",
         "jamba", "glm4_moe", "ernie4_5", "exaone4", "seed_oss", "diffllama", "gpt_neo"]
STEPS = 12
SCALE = 1.5  # the edit: the middle block's output scaled
STRENGTH = 0.5  # the control vector's strength; its direction has the block output's RMS


# type -> (exception, message) of kw.from_hf, as the run gives them
AT_BUILD = {
}

# (type, test) -> the failure of a kvwire model that builds
FAILS = {}


def _params(test):
    params = []
    for model_type in NAMED:
        marks = []
        if model_type in AT_BUILD:
            error, message = AT_BUILD[model_type]
            marks = [pytest.mark.xfail(strict=True, raises=error, reason=message)]
        elif (model_type, test) in FAILS:
            marks = [pytest.mark.xfail(strict=True, reason=FAILS[model_type, test])]
        params.append(pytest.param(model_type, marks=marks, id=model_type))
    return params


def _types_present():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.fixture(scope="module")
def model(request):
    """The type's tiny model: `hf` (transformers, eager attention, its own copy of the weights), `lm`
    (kvwire's generic path over the original), `blocks` (the decoder layers) and `width`."""
    model_type = request.param
    if model_type not in _types_present():
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    original = tiny_model(model_type)
    hf = copy.deepcopy(original)  # kw.from_hf sets the original's attention implementation to kvwire's
    try:
        lm = kw.from_hf(original, generic=True)
    except Exception as e:
        expected = AT_BUILD.get(model_type, (None, None))[1]
        if expected is not None and str(e) != expected:  # another failure than the one marked
            raise AssertionError(f"kw.from_hf({model_type}) raised {type(e).__name__}: {e}") from e
        raise
    return SimpleNamespace(hf=hf, lm=lm, blocks=_decoder_layers(hf), width=lm.head.weight.shape[1])


def _decoder_layers(hf):
    """transformers' decoder layers: the model's list of num_hidden_layers modules."""
    n = hf.config.get_text_config().num_hidden_layers
    return next(m for m in hf.modules() if isinstance(m, nn.ModuleList) and len(m) == n)


def _middle(m):
    return (len(m.blocks) - 1) // 2


def _agrees(logits_of, ids, tokens):
    """kvwire's cached greedy `tokens` are the uncached argmax rollout of `logits_of`, or differ
    from it only where its top two logits tie (teacher-forced; see greedy_disagreements)."""
    tokens = torch.stack(list(tokens)) if isinstance(tokens, list) else tokens
    if torch.equal(tokens, rollout(logits_of, ids, tokens.shape[1])):
        return []
    return greedy_disagreements(logits_of, ids, tokens)


@pytest.mark.parametrize("model", _params("logits"), indirect=True)
def test_logits_equal_transformers(model):
    ids = prompt(2, 11, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(model.lm(ids), hf_logits(model.hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model", _params("greedy"), indirect=True)
def test_cached_greedy_equals_the_uncached_rollout(model):
    ids = prompt(2, 9, seed=2)
    tokens = model.lm.generate(ids, max_new_tokens=STEPS, ignore_eos=True)
    assert _agrees(lambda x: hf_logits(model.hf, x), ids, tokens) == []


@pytest.mark.parametrize("model", _params("padding"), indirect=True)
def test_left_padded_rows_equal_each_alone(model):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(*PROMPT_IDS, (n,), generator=g) for n in (4, 11, 7)]
    batch = model.lm.generate(rows, max_new_tokens=10, ignore_eos=True)
    for i, row in enumerate(rows):
        assert batch[i].tolist() == model.lm.generate(row, max_new_tokens=10, ignore_eos=True).tolist(), i


class Scale(nn.Module):
    def forward(self, x):
        return x * SCALE


@pytest.mark.parametrize("model", _params("edit"), indirect=True)
def test_an_edit_after_the_middle_block_survives_caching(model):
    edited = model.lm.edit(kw.insert_after(f"layers.{_middle(model)}", Scale()))
    ids = prompt(2, 9, seed=4)
    with torch.no_grad():
        assert not torch.allclose(edited(ids), model.lm(ids), atol=1e-3)  # the edit changes the output
    tokens = edited.generate(ids, max_new_tokens=STEPS, ignore_eos=True)
    assert _agrees(edited, ids, tokens) == []


@pytest.mark.parametrize("model", _params("steer"), indirect=True)
def test_a_control_vector_equals_a_hook_on_transformers_block(model):
    """`direction.N` goes after block N (0-based, kvwire's and llama.cpp's numbering): transformers'
    decoder layer N with a forward hook adding strength * direction to its output."""
    n, ids = _middle(model), prompt(2, 9, seed=5)
    block = model.blocks[n]
    seen = []
    handle = block.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    hf_logits(model.hf, ids)
    handle.remove()
    rms = seen[0].pow(2).mean().sqrt().item()
    direction = torch.randn(model.width, generator=torch.Generator().manual_seed(6)) * rms
    steered = model.lm.steer(kw.ControlVector({n: direction}), STRENGTH)

    def add(m, args, out):
        if isinstance(out, tuple):
            return (out[0] + STRENGTH * direction,) + out[1:]
        return out + STRENGTH * direction

    handle = block.register_forward_hook(add)
    try:
        tokens = steered.generate(ids, max_new_tokens=STEPS, ignore_eos=True)
        assert _agrees(lambda x: hf_logits(model.hf, x), ids, tokens) == []
    finally:
        handle.remove()
    with torch.no_grad():
        assert not torch.allclose(steered(ids), model.lm(ids), atol=1e-3)  # the vector changes the output
