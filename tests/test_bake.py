"""Baked steering: a directional ablation baked into every residual write, and an added vector baked
into the MLP output bias, written as Hugging Face folders (loaded back by transformers and kvwire) and
as GGUF files (loaded back by kvwire and llama.cpp), equal to the same steering done at run time by
kvwire's graph layers; families and files where baking is not exact are refused by name."""
import importlib.util
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

import kvwire as kw
from kvwire.steer.bake import bake_ablation, bake_steer

from .conftest import FAMILIES, tiny_hf_gpt2
from .gguf_families import write_gguf
from .gguf_files import write_gpt2
from .tiny_models import tiny_hf
from .tokenizers_for_tests import byte_level

IDS = torch.tensor([[3, 17, 42, 9, 55, 23, 7, 61, 30]])
llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                               reason="llama.cpp runs need llama-cpp-python (kvwire[ggml])")


def ablated(lm, d, s=1.0):
    """kvwire's run-time ablation at every residual write: the embedding (block 0's resid_pre),
    then what attention and the MLP of every block add."""
    return lm.ablate(d, layers=[0], site="resid_pre", strength=s).ablate(d, site="attn_out", strength=s) \
        .ablate(d, site="mlp_out", strength=s)


def hf_logits(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(IDS).logits, model


def _directions(k, width=32, seed=1):
    return torch.randn(k, width, generator=torch.Generator().manual_seed(seed))


# -- ablation, Hugging Face folders -----------------------------------------------------------------

# GQA without biases (llama, untied); q/k/v biases and a tied head (qwen2); the embedding and
# residual multipliers (granite); Conv1D, learned positions and a tied head (gpt2); fused projections
# (phi3); a scaled embedding and a tied head (gemma)
@pytest.mark.parametrize("family", ["llama", "qwen2", "granite", "gpt2", "phi3", "gemma"])
def test_baked_ablation_equals_ablating_every_residual_write(family, tmp_path):
    hf = FAMILIES[family]()
    lm = kw.from_hf(hf)
    tied = hf.config.tie_word_embeddings
    embedding = hf.get_input_embeddings().weight.detach().clone()
    d, s = (_directions(2), 1.0) if family != "granite" else (_directions(1)[0], 0.5)
    want = ablated(lm, d, s)(IDS)
    assert (want - lm(IDS)).abs().max() > 0.02  # the ablation does something here (200 times the tolerance)
    got, baked = hf_logits(bake_ablation(hf, d, tmp_path / "baked", strength=s))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not baked.config.tie_word_embeddings
    if tied:  # the head keeps the original embedding; the input embedding is orthogonalised
        assert torch.equal(baked.get_output_embeddings().weight, embedding)
        q = torch.linalg.qr(d.reshape(-1, 32).T)[0]  # (D, K)
        assert (baked.get_input_embeddings().weight @ q).abs().max() < 1e-5


def test_a_folder_is_baked_with_its_tokenizer_and_kvwire_loads_it(tmp_path):
    hf = tiny_hf("qwen2", vocab_size=300)  # tied
    hf.save_pretrained(tmp_path / "src", max_shard_size="20KB")  # sharded
    byte_level(300).backend.save(str(tmp_path / "src" / "tokenizer.json"))
    d = _directions(1)[0]
    out = bake_ablation(tmp_path / "src", d, tmp_path / "baked")
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["model_type"] == "qwen2"
    lm = kw.load(tmp_path / "src", progress=False)
    torch.testing.assert_close(kw.load(out, progress=False)(IDS), ablated(lm, d)(IDS), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hf_logits(out)[0], ablated(lm, d)(IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,name", [("gemma3", "Gemma 3"), ("olmo2", "OLMo 2"), ("gemma2", "Gemma 2")])
def test_families_with_a_norm_after_the_writes_are_refused_by_name(family, name, tmp_path):
    hf = FAMILIES[family]()
    with pytest.raises(ValueError, match=f"cannot bake into {name} .*has a norm after the attention output"):
        bake_ablation(hf, _directions(1)[0], tmp_path / "x")
    with pytest.raises(ValueError, match=f"cannot bake into {name} "):
        bake_steer(hf, {0: _directions(1)[0]}, 1.0, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# -- steer, Hugging Face folders --------------------------------------------------------------------

@pytest.mark.parametrize("family,overrides,add_bias", [
    ("llama", dict(mlp_bias=True), False), ("llama", {}, True), ("granite", dict(mlp_bias=True), False),
    ("granite", {}, True), ("gpt2", {}, False)], ids=["llama", "llama-add-bias", "granite", "granite-add-bias", "gpt2"])
def test_baked_steer_equals_lm_steer(family, overrides, add_bias, tmp_path):
    hf = FAMILIES[family](**overrides)
    lm = kw.from_hf(hf)
    g = torch.Generator().manual_seed(2)
    vec = kw.ControlVector({i: torch.randn(32, generator=g) for i in (0, 2)})
    want = lm.steer(vec, 1.5)(IDS)
    assert (want - lm(IDS)).abs().max() > 0.1
    out = bake_steer(hf, vec, 1.5, tmp_path / "baked", add_bias=add_bias)
    got, baked = hf_logits(out)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if family != "gpt2":
        assert baked.config.mlp_bias
        torch.testing.assert_close(kw.load(out, progress=False)(IDS), want, atol=1e-4, rtol=1e-4)
    if add_bias:  # the blocks not steered get zero biases, and gate/up everywhere
        mlp = baked.model.layers[1].mlp
        assert all(not p.bias.any() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    # a vector made for mlp_out adds the same sum
    at_mlp = kw.ControlVector(vec.directions, site="mlp_out")
    got, _ = hf_logits(bake_steer(hf, at_mlp, 1.5, tmp_path / "mlp", add_bias=add_bias))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_steer_without_an_mlp_bias_is_refused_saying_what_would_work(tmp_path):
    vec = {0: _directions(1)[0]}
    with pytest.raises(ValueError, match=r"no MLP biases \(mlp_bias: false\).*add_bias=True sets mlp_bias: true"):
        bake_steer(FAMILIES["llama"](), vec, 1.0, tmp_path / "x")
    for family in ("qwen2", "mistral", "phi3"):
        with pytest.raises(ValueError, match=f"transformers' {family} MLP has no bias, and its config has no switch"):
            bake_steer(FAMILIES[family](), vec, 1.0, tmp_path / "x", add_bias=True)


# -- bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("directions,kwargs,error,match", [
    (torch.ones(31), {}, ValueError, "directions have width 31, but the model's hidden size is 32"),
    (torch.full((32,), float("nan")), {}, ValueError, "directions holds NaN or infinite values"),
    (torch.zeros(32), {}, ValueError, "directions row 0 is all zeros"),
    (torch.ones(2, 32), {}, ValueError, "row 1 lies in the span of the rows before it"),
    (torch.ones(2, 2, 32), {}, ValueError, r"must be \(D,\) or \(K, D\).*got shape \(2, 2, 32\)"),
    (torch.ones(32), dict(strength=float("nan")), ValueError, "strength must be a finite number, got nan"),
    (torch.ones(32), dict(format="onnx"), ValueError, r"format must be one of \('safetensors', 'gguf'\), got 'onnx'"),
    (torch.ones(32), dict(tensor_type="f16"), ValueError, "tensor_type is for format='gguf' only"),
    ({3: torch.ones(32)}, {}, TypeError, r"takes one \(D,\) or \(K, D\) tensor.*vec.directions\[12\]"),
], ids=["width", "nan", "zero", "dependent", "3d", "strength", "format", "tensor-type", "dict"])
def test_bad_ablation_input_is_refused_naming_what_was_given(directions, kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        bake_ablation(FAMILIES["llama"](), directions, tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("vector,match", [
    ({0: torch.ones(31)}, "control vector width 31 does not fit the model's hidden size 32"),
    ({4: torch.ones(32)}, "control vector steers block 4, but the model has blocks 0-3"),
    ({0: torch.full((32,), float("inf"))}, "control vector block 0 holds NaN or infinite values"),
    (kw.ControlVector({0: torch.ones(32)}, operation="ablate"), "bakes a vector added at block_out.*made to ablate"),
    (kw.ControlVector({0: torch.ones(32)}, site="attn_out"), "bakes a vector added at block_out.*add at attn_out"),
], ids=["width", "block", "inf", "operation", "site"])
def test_bad_steer_input_is_refused_naming_what_was_given(vector, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        bake_steer(FAMILIES["llama"](mlp_bias=True), vector, 1.0, tmp_path / "x")


def test_the_source_is_never_overwritten(tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is the source folder"):
        bake_ablation(tmp_path, _directions(1)[0], tmp_path)


# -- GGUF -----------------------------------------------------------------------------------------------

def _gguf(tmp_path, family, quant=GGMLQuantizationType.Q8_0):
    path = tmp_path / f"{family}.gguf"
    if family == "gpt2":
        write_gpt2(path, tiny_hf_gpt2(vocab_size=300), quant)
    else:
        write_gguf(path, tiny_hf(family, vocab_size=300), quant=quant)
    return path


def _raw(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return t.tensor_type, bytes(t.data.tobytes())


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied; tied (the file gains output.weight)
def test_baked_gguf_equals_ablating_every_write_and_copies_the_rest(family, tmp_path):
    src = _gguf(tmp_path, family)
    lm = kw.load(src, progress=False)
    d = _directions(2)
    out = bake_ablation(src, d, tmp_path / "baked.gguf", format="gguf")
    torch.testing.assert_close(kw.load(out, progress=False)(IDS), ablated(lm, d)(IDS), atol=1e-4, rtol=1e-4)
    before, after = GGUFReader(str(src)), GGUFReader(str(out))
    fields = {k: (f.types, f.contents()) for k, f in before.fields.items() if not k.startswith("GGUF.")}
    assert {k: (f.types, f.contents()) for k, f in after.fields.items() if not k.startswith("GGUF.")} == fields
    touched = {t.name for t in after.tensors if t.name.split(".")[-2] in ("token_embd", "attn_output", "ffn_down")}
    assert len(touched) == 1 + 2 * lm.config.num_hidden_layers
    for t in before.tensors:
        kind, raw = _raw(after, t.name)
        if t.name in touched:
            assert kind == GGMLQuantizationType.F32
        else:
            assert (kind, raw) == _raw(before, t.name), t.name
    if lm.config.tie_word_embeddings:  # the head: the original embedding's own Q8_0 blocks
        assert _raw(after, "output.weight") == _raw(before, "token_embd.weight")


def test_gguf_f16_and_refusals(tmp_path):
    src = _gguf(tmp_path, "llama", GGMLQuantizationType.F32)
    out = bake_ablation(src, _directions(1)[0], tmp_path / "f16.gguf", format="gguf", tensor_type="f16")
    types = {t.name: t.tensor_type for t in GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_down.weight"] == GGMLQuantizationType.F16 == types["token_embd.weight"]
    lm = kw.load(src, progress=False)
    torch.testing.assert_close(kw.load(out, progress=False)(IDS), ablated(lm, _directions(1)[0])(IDS),
                               atol=2e-2, rtol=1e-2)
    gemma2 = _gguf(tmp_path, "gemma2", GGMLQuantizationType.F32)
    with pytest.raises(ValueError, match=r"cannot bake into .*gemma2.gguf: Gemma 2 \('gemma2'\) has a norm after"):
        bake_ablation(gemma2, _directions(1)[0], tmp_path / "x.gguf", format="gguf")
    qwen2 = _gguf(tmp_path, "qwen2")
    with pytest.raises(ValueError, match="cannot bake a steer into .*its architecture 'qwen2' is not one kvwire "
                                         r"bakes steers into \(it does for llama, gpt2\)"):
        bake_steer(qwen2, {0: torch.ones(32)}, 1.0, tmp_path / "x.gguf", format="gguf")
    with pytest.raises(ValueError, match="directions have width 31, but the model's hidden size is 32"):
        bake_ablation(qwen2, torch.ones(31), tmp_path / "x.gguf", format="gguf")
    with pytest.raises(ValueError, match="is the source file"):
        bake_ablation(qwen2, torch.ones(32), qwen2, format="gguf")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("quant", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_kvwire_loads_a_baked_llama_gguf_as_the_steered_model(quant, tmp_path):
    """The file has blk.N.ffn_down.bias on the steered blocks only (llama.cpp reads it where a block
    has one): those blocks get a down-projection bias, the others none; the converted config goes
    through kvwire's weights cache and back."""
    src = _gguf(tmp_path, "llama", quant)
    lm = kw.load(src, progress=False)
    vec = kw.ControlVector({0: _directions(1, seed=3)[0], 2: _directions(1, seed=4)[0]})
    want = lm.steer(vec, 1.5)(IDS)
    assert (want - lm(IDS)).abs().max() > 0.1
    out = bake_steer(src, vec, 1.5, tmp_path / "s.gguf", format="gguf")
    for baked in (kw.load(out, progress=False), kw.load(out, progress=False)):  # converted, then cached
        assert baked.config.mlp_out_bias == (True, False, True, False) and not baked.config.mlp_bias
        assert [b.mlp.down_proj.bias is not None for b in baked.backbone.layers] == [True, False, True, False]
        torch.testing.assert_close(baked(IDS), want, atol=1e-4, rtol=1e-4)
    generated = [m.generate_ids(IDS, max_new_tokens=6, ignore_eos=True).tokens for m in (baked, lm.steer(vec, 1.5))]
    assert generated[0] == generated[1]  # through the cached graph


@llama_cpp
def test_a_baked_q8_0_gguf_runs_on_its_own_blocks_as_kvwire_steers(tmp_path):
    """quantize="gguf": the untouched Q8_0 blocks on ggml's kernels, the steered blocks' F32 bias added
    after their down projection; the same as the source's blocks steered at run time."""
    from kvwire.quant.ggml import GGMLLinear

    src = _gguf(tmp_path, "llama", GGMLQuantizationType.Q8_0)
    vec = kw.ControlVector({1: _directions(1, seed=3)[0], 3: _directions(1, seed=4)[0]})
    lm = kw.load(src, progress=False, quantize="gguf")
    baked = kw.load(bake_steer(src, vec, 1.5, tmp_path / "s.gguf", format="gguf"), progress=False, quantize="gguf")
    downs = [b.mlp.down_proj for b in baked.backbone.layers]
    assert all(isinstance(d, GGMLLinear) for d in downs) and [d.bias is not None for d in downs] == [False, True,
                                                                                                    False, True]
    want = lm.steer(vec, 1.5)(IDS)
    assert (want - lm(IDS)).abs().max() > 0.1
    assert ((baked(IDS) - want).norm() / want.norm()).item() < 1e-4  # the same blocks; sums in another order


def _llama_cpp_logits(path, ids):
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    rows = []
    for row in ids:
        llm.reset()
        llm.eval(row)
        rows.append(np.array(llm.scores[len(row) - 1]))
    return torch.tensor(np.stack(rows))


@llama_cpp
@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: learned positions, biases, a tied head
def test_llama_cpp_runs_baked_gguf_files_as_kvwire_steers(family, tmp_path):
    src = _gguf(tmp_path, family, GGMLQuantizationType.F32)
    lm = kw.from_hf(tiny_hf_gpt2(vocab_size=300)) if family == "gpt2" else kw.load(src, progress=False)
    d, vec = _directions(2), kw.ControlVector({0: _directions(1, seed=3)[0], 2: _directions(1, seed=4)[0]})
    ids = IDS.tolist()
    for out, model in ((bake_ablation(src, d, tmp_path / "a.gguf", format="gguf"), ablated(lm, d)),
                       (bake_steer(src, vec, 1.5, tmp_path / "s.gguf", format="gguf"), lm.steer(vec, 1.5))):
        want = model(IDS)[:, -1]
        assert (want - lm(IDS)[:, -1]).abs().max() > 0.1
        # llama.cpp's float32 arithmetic on the same weights: measured within 2.2e-4 of kvwire
        torch.testing.assert_close(_llama_cpp_logits(out, ids), want, atol=1e-3, rtol=1e-3)


# -- the real model -------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The best way to learn a language is", "Once upon a time, in a small village by the sea,"]


def _corr(a, b):
    return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()


@pytest.mark.real
@llama_cpp
def test_smollm2_gguf_baked_runs_in_llama_cpp_as_kvwire_steers(tmp_path):
    """SmolLM2's Q4_1/Q8_0 GGUF with a random unit direction ablated at every write (and a vector
    added at four blocks): llama.cpp's next-token logit changes on the baked file correlate with
    kvwire's run-time changes (measured 0.992 for the ablation and 0.999 for the vector; llama.cpp's
    own 8-bit activations on the untouched Q4_1 blocks are the difference). ~25 s."""
    from kvwire.models.presets import PRESETS

    src, lm = PRESETS["smollm2-135m-instruct"](), kw.load("smollm2-135m-instruct", progress=False)
    g = torch.Generator().manual_seed(0)
    d = torch.randn(576, generator=g)
    d = d / d.norm()
    vec = kw.ControlVector({i: torch.randn(576, generator=g) * 0.5 for i in (8, 12, 16, 20)})
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]

    def last(model):
        with torch.inference_mode():
            return torch.stack([model(torch.tensor([row]))[0, -1] for row in ids])

    plain, theirs = last(lm), _llama_cpp_logits(src, ids)
    for out, model in ((bake_ablation(src, d, tmp_path / "a.gguf", format="gguf"), ablated(lm, d)),
                       (bake_steer(src, vec, 4.0, tmp_path / "s.gguf", format="gguf"), lm.steer(vec, 4.0))):
        ours = last(model) - plain
        assert ours.norm() > 0.1 * plain.norm()  # a large change, not llama.cpp's noise
        assert _corr(_llama_cpp_logits(out, ids) - theirs, ours) >= 0.98, out.name


def test_kvwire_loads_a_baked_gpt2_with_its_own_head(tmp_path):
    """GPT-2 baked folders and GGUF files carry an untied head (the original embedding): kvwire keeps it."""
    hf = tiny_hf_gpt2(vocab_size=300)
    lm, d = kw.from_hf(hf), _directions(2)
    want = ablated(lm, d)(IDS)
    folder = bake_ablation(hf, d, tmp_path / "baked")
    torch.testing.assert_close(kw.load(folder, progress=False)(IDS), want, atol=1e-4, rtol=1e-4)
    src = _gguf(tmp_path, "gpt2", GGMLQuantizationType.F32)
    baked = kw.load(bake_ablation(src, d, tmp_path / "baked.gguf", format="gguf"), progress=False)
    assert not baked.config.tie_word_embeddings
    torch.testing.assert_close(baked(IDS), want, atol=1e-4, rtol=1e-4)
