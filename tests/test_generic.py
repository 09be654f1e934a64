"""The generic path: transformers' own modules as a kvwire layer graph, cached by the cache pass.
The arbiter is transformers' uncached forward on the same weights."""
import copy
import re
from pathlib import Path

import pytest
import torch

import kvwire as kw
from kvwire.models.generic.experts import dense_experts, experts_modules

from .conftest import FAMILIES
from .generic_configs import greedy_disagreements, prompt, tiny_model

transformers = pytest.importorskip("transformers")

# every native family, forced through the generic path: rings (gemma2/3, mistral, phi3, qwen2's
# window layers), learned positions (gpt2), soft-caps (gemma2), QK-norm (gemma3, qwen3, olmo2)
NATIVE = sorted(FAMILIES)


def rollout(hf, ids, steps):
    """transformers' uncached greedy argmax rollout (the ground truth)."""
    x = ids
    with torch.no_grad():
        for _ in range(steps):
            x = torch.cat([x, hf(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[:, ids.shape[1]:]


@pytest.fixture(scope="module", params=NATIVE)
def pair(request):
    hf = FAMILIES[request.param]().eval()
    return request.param, hf, kw.from_hf(hf, generic=True)


def test_logits_equal_transformers(pair):
    _, hf, lm = pair
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_cached_greedy_equals_the_uncached_rollout(pair):
    _, hf, lm = pair
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(2))
    out = lm.generate(ids, max_new_tokens=14, ignore_eos=True)
    assert [o.tolist() for o in out] == rollout(hf, ids, 14).tolist()


def test_left_padded_rows_equal_each_alone(pair):
    _, _, lm = pair
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 90, (n,), generator=g) for n in (4, 12, 7)]
    batch = lm.generate(rows, max_new_tokens=10, ignore_eos=True, return_logprobs=True)
    for i, row in enumerate(rows):
        alone = lm.generate(row, max_new_tokens=10, ignore_eos=True, return_logprobs=True)
        assert batch.tokens[i] == alone.tokens[0]
        torch.testing.assert_close(torch.tensor(batch.logprobs[i]), torch.tensor(alone.logprobs[0]),
                                   atol=1e-4, rtol=1e-4)


def test_the_native_path_stays_for_mapped_families():
    assert kw.from_hf(FAMILIES["llama"]().eval()).family == "llama"


def test_no_table_keyed_by_model_type():
    # the generic path finds everything by probing the model; a per-family table would show up as
    # model_type (or a family's name) in its source
    source = "\n".join(p.read_text() for p in Path(kw.__file__).parent.joinpath("models/generic").glob("*.py"))
    assert "model_type" not in source
    types = set(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
    quoted = set(re.findall(r"""["']([a-z0-9_]+)["']""", source))
    assert not (quoted & types), sorted(quoted & types)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_steering_a_generic_model_equals_the_native_path(family):
    hf = FAMILIES[family]().eval()
    native, generic = kw.from_hf(hf), kw.from_hf(hf, generic=True)
    width = native.head.weight.shape[1]
    vec = kw.ControlVector({2: 4 * torch.randn(width, generator=torch.Generator().manual_seed(0))})
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(2))
    steered = generic.steer(vec, 1.0)
    assert steered.cached.names == [f"layers.{i}" for i in range(len(generic.backbone.layers))]
    ours = steered.generate(ids, max_new_tokens=10, ignore_eos=True, return_logprobs=True)
    theirs = native.steer(vec, 1.0).generate(ids, max_new_tokens=10, ignore_eos=True, return_logprobs=True)
    assert ours.tokens == theirs.tokens
    torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=1e-4)
    assert ours.tokens != generic.generate(ids, max_new_tokens=10, ignore_eos=True, return_logprobs=True).tokens


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_the_modules_own_eager_attention_serves_cached_calls_too(family):
    """Layers whose attention kvwire's math does not reproduce (sinks, say) run the module's own eager
    function over cache + chunk: forced here on rings and soft-caps, it equals the rollout too."""
    hf = FAMILIES[family]().eval()
    lm = kw.from_hf(hf, generic=True)
    assert all(layer.plain_math for layer in lm.backbone.layers)  # the probe found kvwire's math fits
    for layer in lm.backbone.layers:
        layer.plain_math = False
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 90, (n,), generator=g) for n in (5, 11)]
    out = lm.generate(rows, max_new_tokens=12, ignore_eos=True)
    for row, got in zip(rows, out):
        assert got.tolist() == rollout(hf, row[None], 12)[0].tolist()


def tiny_starcoder2():
    config = transformers.AutoConfig.for_model(
        "starcoder2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128, sliding_window=5, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_a_folder_of_a_type_kvwire_has_no_family_for_takes_the_generic_path(tmp_path):
    hf = tiny_starcoder2()
    hf.save_pretrained(tmp_path)
    lm = kw.load(str(tmp_path))
    assert lm.family == "generic" and lm.max_context == 128
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(5))
    assert lm.generate(ids, max_new_tokens=10, ignore_eos=True)[0].tolist() == rollout(hf, ids, 10)[0].tolist()


def test_a_folder_with_its_own_code_needs_trust_remote_code(tmp_path):
    tiny_starcoder2().save_pretrained(tmp_path)
    config = (tmp_path / "config.json")
    data = config.read_text().replace('"model_type"', '"auto_map": {"AutoModelForCausalLM": "x.Model"}, "model_type"')
    config.write_text(data)
    with pytest.raises(ValueError, match=r"the model's code comes with the folder .*trust_remote_code=True"):
        kw.load(str(tmp_path))


def test_encoder_decoders_are_refused_by_name():
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model; kvwire runs "
                                         "decoder-only language models"):
        kw.from_hf(model)


def test_a_generic_model_exports_to_onnx_and_runs_the_same_tokens(tmp_path):
    pytest.importorskip("onnxruntime")
    from kvwire.export import load_exported

    hf = FAMILIES["gemma3"](num_hidden_layers=2).eval()  # GQA, a ring of a sliding layer, QK-norm
    lm = kw.from_hf(hf, generic=True)
    kw.export(lm, tmp_path / "m.onnx", max_length=48)
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(6))
    expected = rollout(hf, ids, 12)[0].tolist()
    assert load_exported(tmp_path / "m.onnx").generate(ids, max_new_tokens=12, ignore_eos=True)[0].tolist() == expected



def test_a_layer_making_two_attention_calls_keeps_a_cache_per_call():
    """Differential attention (DiffLlama) calls the attention function twice per layer, with the same
    keys and two halves of the values: each call gets its own cache, taken in call order."""
    hf, lm = _generic("diffllama")
    layer = lm.backbone.layers[0]
    assert len(layer.calls) == 2 and list(layer.cache_parts) == ["attention", "attention2"]
    assert len(lm.cached.slots) == 2 * len(lm.backbone.layers)
    rows = [prompt(1, 7, 1)[0], prompt(1, 4, 2)[0]]  # left-padded together
    got = lm.generate(rows, max_new_tokens=8, ignore_eos=True)
    for r, row in enumerate(rows):
        assert got[r].tolist()[-8:] == rollout(hf, row[None], 8)[0].tolist(), r


# MoE with latent attention (DeepSeek-V3) and with sinks (gpt-oss); plain MoE (Mixtral, 17-21 s) is heavy:
# the other two run its experts' dense form too
@pytest.mark.parametrize("model_type", [pytest.param("mixtral", marks=pytest.mark.heavy), "deepseek_v3", "gpt_oss"])
def test_a_moe_model_exports_to_onnx_and_runs_transformers_tokens(model_type, tmp_path):
    """transformers' experts index tokens by expert (data-dependent shapes); the export traces them in
    kvwire's dense form (every expert on every token, weighted by the router) instead."""
    pytest.importorskip("onnxruntime")
    from kvwire.export import load_exported

    hf, lm = _generic(model_type, num_hidden_layers=2)  # dense + experts (DeepSeek), sliding + full (gpt-oss)
    kw.export(lm, tmp_path / "m.onnx", max_length=48)
    ids = prompt(1, 9, 6)
    got = load_exported(tmp_path / "m.onnx").generate(ids, max_new_tokens=12, ignore_eos=True)[0].tolist()
    assert got[-12:] == rollout(hf, ids, 12)[0].tolist()
    implementations = {m.config._experts_implementation for m in experts_modules(lm.backbone)}
    assert implementations and "kvwire_dense" not in implementations  # put back after the export


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "olmoe"])  # gpt-oss: biases, transposed, own gate
def test_the_dense_experts_form_equals_transformers_own(model_type):
    model = tiny_model(model_type)
    experts = experts_modules(model)[0]
    count, width = experts.down_proj.shape[0], experts.down_proj.shape[2 if experts.is_transposed else 1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, width, generator=g)
    index = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)
    with torch.no_grad():
        want = experts(x, index, weights)
        with dense_experts(model) as found:
            got = experts(x, index, weights)
    assert found == len(experts_modules(model)) > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(want.abs().max()) > 1e-3


# Mamba-2 and Qwen3-Next's gated delta-net (static chunk scans) in every run; heavy (KVWIRE_HEAVY_TESTS=1):
# MoE (dense form), RecurrentGemma (state in module attributes, stepped token by token), MiniMax (state in
# a cache class of its own, continued token by token by its own code). Their caching runs in every run
# without export (test_generic_families.py, test_generic_state.py), and MoE exports to ONNX above. Two
# layers (an export's time grows with each), one of each kind in hybrids.
EXPORT_LAYERS = {"mixtral": dict(num_hidden_layers=2), "mamba2": dict(num_hidden_layers=2),
                 # a delta-net and an attention layer, dense MLPs (experts export above)
                 "qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                    mlp_only_layers=[0, 1]),
                 "recurrent_gemma": dict(num_hidden_layers=2, block_types=["recurrent", "attention"]),
                 "minimax": dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])}


@pytest.mark.parametrize("model_type", [pytest.param("mixtral", marks=pytest.mark.heavy), "mamba2", "qwen3_next",
                                        pytest.param("recurrent_gemma", marks=pytest.mark.heavy),
                                        pytest.param("minimax", marks=pytest.mark.heavy)])
def test_a_model_exports_to_executorch_and_runs_transformers_tokens(model_type, tmp_path):
    """ExecuTorch takes one static entry point per chunk length: transformers' chunked scans, whose
    loop count follows the chunk's length, export there (not into ONNX's one dynamic graph)."""
    pytest.importorskip("executorch")
    from kvwire.export import load_exported

    hf, lm = _generic(model_type, **EXPORT_LAYERS.get(model_type, {}))
    kw.export(lm, tmp_path / "m.pte", max_length=32, delegate="portable", prefill_length=8)
    ids = prompt(1, 9, 6)
    got = load_exported(tmp_path / "m.pte").generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()
    assert got[-8:] == rollout(hf, ids, 8)[0].tolist()


def test_onnx_refuses_a_state_continued_token_by_token_naming_its_layers(tmp_path):
    """MiniMax's lightning attention continues a handed state with a Python loop over the chunk's
    tokens, so a trace makes the chunk length a constant: the ONNX export (one dynamic-chunk graph)
    fails naming the layers keeping state and their mixer, and says what exports instead."""
    pytest.importorskip("onnxruntime")
    from kvwire.export.check import ExportFailure

    _, lm = _generic("minimax")
    with pytest.raises(ExportFailure) as e:
        kw.export(lm, tmp_path / "m.onnx", max_length=32)
    message = str(e.value)
    assert "'layers.1', 'layers.3'" in message and "MiniMaxLightningAttention" in message
    assert "prefill_length" in message
    assert not (tmp_path / "m.onnx").exists()


def test_onnx_refuses_a_layer_handed_its_state_naming_it(tmp_path):
    """RWKV's blocks are handed their state by the model's forward and take no padding mask, so a
    chunk where a row starts late goes token by token, which a dynamic-chunk graph cannot hold:
    the ONNX export fails naming the block and saying what exports instead (ExecuTorch with
    prefill_length exports it: measured, not run here, two minutes a model)."""
    pytest.importorskip("onnxruntime")
    from kvwire.export.check import ExportFailure

    _, lm = _generic("rwkv")
    with pytest.raises(ExportFailure) as e:
        kw.export(lm, tmp_path / "m.onnx", max_length=32)
    assert "RwkvBlock" in str(e.value) and "prefill_length" in str(e.value)
    assert not (tmp_path / "m.onnx").exists()


def test_a_window_only_the_mask_keeps_is_read_from_the_mask():
    """PhiMoE passes no window to the attention function and keeps none on its modules: its sliding
    window is in transformers' mask alone. The probe reads it there, and a ring cache of that window
    gives transformers' tokens past it (prompt and generation longer than the window of 6)."""
    from kvwire.models.generic.seam import mask_window

    hf, lm = _generic("phimoe")
    assert {part.window for part in lm.backbone.layers} == {6}
    ids = prompt(1, 9, 3)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()
    i = torch.arange(8)
    behind = i[:, None] - i[None, :]
    additive = torch.zeros(8, 8).masked_fill(~((behind >= 0) & (behind < 3)), torch.finfo(torch.float32).min)
    assert mask_window(additive[None, None], 8) == 3
    assert mask_window((behind >= 0)[None, None], 8) is None  # full causal
    assert mask_window(((behind >= 0) & (i[:, None] // 4 == i[None, :] // 4))[None, None], 8) is None  # chunked
    assert mask_window(None, 8) is None


def _generic(model_type, **fields):
    """(transformers' tiny model of `model_type`, kvwire's generic model over a copy of its weights;
    `fields`: config fields, e.g. two layers where a test exports)."""
    original = tiny_model(model_type, **fields)
    hf = copy.deepcopy(original)  # kw.from_hf sets the original's attention implementation to kvwire's
    return hf, kw.from_hf(original, generic=True)


def test_indices_a_layer_hands_the_next_are_carried():
    """HunYuan V4's shared sparse-attention layers take the top-k indices an earlier layer returned
    beside its hidden states: carried from layer to layer, the model runs, cached, and equals
    transformers'."""
    _present("hy_v4")
    hf, lm = _generic("hy_v4")
    assert any(part.carried for part in lm.backbone.layers) and lm.backbone.rerun_reason is None
    ids = prompt(2, 11, 3)
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    tokens = torch.stack(lm.generate(ids, max_new_tokens=8, ignore_eos=True))
    assert greedy_disagreements(lambda x: hf(x).logits, ids, tokens) == []  # near-ties teacher-forced


def test_what_the_forward_does_after_its_layers_runs_as_transformers_writes_it():
    """Gemma 3n's layers carry a stack of AltUp streams; after the last layer its forward unembeds
    and averages them (not modules one after another): the tail replays the forward with stand-ins
    for the layers, and cached greedy tokens equal transformers' rollout."""
    from kvwire.models.generic.parts import ReplayTail

    hf, lm = _generic("gemma3n_text")
    assert isinstance(lm.backbone.tail, ReplayTail)
    ids = prompt(1, 7, 4)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()


def test_the_probe_avoids_the_ids_a_multimodal_config_names_special():
    """Gemma 4's multimodal wrapper swaps the embeddings of its image/audio/video placeholder ids
    for encoder outputs; the build's probe draws none of them, and text generation equals
    transformers'."""
    from kvwire.models.generic.build import _probe_ids, _special_ids

    hf, lm = _generic("gemma4")
    special = _special_ids(hf.config)
    assert {hf.config.image_token_id, hf.config.audio_token_id} <= special
    assert not set(_probe_ids(hf.config.get_text_config(), hf).flatten().tolist()) & special
    ids = prompt(1, 7, 5)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()


def test_a_layer_the_forward_skips_on_text_is_the_identity():
    """Mllama's forward skips its cross-attention layers when there are no image states: on text
    they are identities in kvwire too, still counted by `layers.N`."""
    from kvwire.models.generic.parts import UncalledLayer

    hf, lm = _generic("mllama")
    skipped = [i for i, part in enumerate(lm.backbone.layers) if isinstance(part, UncalledLayer)]
    config = hf.config.get_text_config()
    assert len(lm.backbone.layers) == config.num_hidden_layers
    assert skipped and skipped == [i for i in config.cross_attention_layers if i < config.num_hidden_layers]
    ids = prompt(1, 7, 6)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()


def test_decoder_layers_whose_count_is_of_sublayers_are_found():
    """LongCat-Flash's num_hidden_layers counts sublayers (two attention calls and two MLPs per
    decoder layer): the base model's one list of layers is taken, each layer caching two calls."""
    hf, lm = _generic("longcat_flash")
    assert len(lm.backbone.layers) * 2 == hf.config.num_hidden_layers
    assert all(len(part.calls) == 2 for part in lm.backbone.layers)
    ids = prompt(1, 7, 7)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()


def _present(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


def test_what_a_layer_hands_the_next_beside_its_hidden_states_is_carried():
    """Zaya's layers return (hidden, router states) and its forward passes the router states to the
    next layer: the build finds the link on the probe, and cached greedy equals transformers'."""
    _present("zaya")
    hf, lm = _generic("zaya")
    assert [part.carried for part in lm.backbone.layers][1:] == [[(1, 0)]] * (len(lm.backbone.layers) - 1)
    ids = prompt(1, 7, 8)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()


def test_decoder_layers_held_below_the_base_model_are_found():
    """GIT's text layers are `encoder.layer` of its base model, beside an image encoder's list of
    as many layers: the build takes the list nearest the base model. Its forward widens a 2D
    padding mask by an image's tokens once the cache holds some, so its timeline mask goes in
    finished (4D); text generation equals transformers', left-padded rows each alone."""
    _present("git")
    hf, lm = _generic("git")
    assert lm.backbone.prelude.layers_name == "encoder.layer"
    assert lm.backbone.rerun_reason is None and lm.backbone.prelude.finished_mask
    ids = prompt(1, 7, 9)
    assert lm.generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()[-8:] == rollout(hf, ids, 8)[0].tolist()
    rows = [prompt(1, n, seed=n)[0] for n in (4, 9)]
    batch = lm.generate(rows, max_new_tokens=6, ignore_eos=True)
    for i, row in enumerate(rows):
        assert batch[i].tolist() == lm.generate(row, max_new_tokens=6, ignore_eos=True).tolist(), i


def test_attention_across_a_tokens_layers_is_not_attention_across_tokens():
    """Inkling 2's block attention residuals attend, at each token, over earlier blocks' outputs
    (non-causal, with the tokens where heads go): the model is not refused as bidirectional."""
    _present("inkling2_text")
    with pytest.warns(UserWarning, match="rerun"):
        hf, lm = _generic("inkling2_text")
    ids = prompt(2, 9, 10)
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type, reason", [
    ("xlnet", r"its logits at a token depend on later tokens .* kvwire runs causal language models"),
    ("dory", r"its forward runs decoder layer 0 \(DoryDecoderLayer\) 2 times \(a looped or recurrent-depth model\)"),
    ("cpmant", r"hidden states of shape \(2, 44, 64\) for 2 rows of 12 tokens"),  # a learned prompt prepended
    ("blt", r"cannot find its base model: its config names no number of decoder layers .* its module lists are "
            r"model\.local_encoder\.layers \(4\)"),
])
def test_models_the_split_cannot_hold_are_refused_saying_why(model_type, reason):
    _present(model_type)
    with pytest.raises(ValueError, match=reason):
        kw.from_hf(tiny_model(model_type), generic=True)


def test_a_model_whose_logits_read_later_tokens_is_refused():
    """An embedding hook adding the sequence's mean makes every logit depend on later tokens: the
    build refuses the model as not causal (no cache, nor a rerun, can serve it)."""
    hf = tiny_model("llama")
    hf.get_input_embeddings().register_forward_hook(lambda m, a, out: out + out.mean(dim=1, keepdim=True))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: its logits at a token depend on later tokens \(other "
                                         r"tokens after the first 6 of a probe give other logits before them\)"):
        kw.from_hf(hf, generic=True)
