"""Sites inside one-call layers: the per-head site ("attn_heads", inside attention) and the residual
sites of generic (transformers) blocks. Each operation there == the same operation written with
transformers forward hooks; cached == uncached; rows with different settings == each alone; export."""
import pytest
import torch

import kvwire as kw
from kvwire.graph.sites import inner_calls

from .conftest import FAMILIES
from .generic_configs import tiny_model
from .test_guards import _rollout
from .test_steer_ops import IDS, hf_logits, ref_ablate, ref_add, ref_clamp

INNER = ("resid_pre", "attn_out", "resid_mid", "mlp_out")


def _directions(width, k, seed):
    return torch.randn(k, width, generator=torch.Generator().manual_seed(seed))


def _out_proj(hf, index):
    """transformers' output projection of block `index`'s attention (its input is the heads' site)."""
    layer = hf.transformer.h[index] if hasattr(hf, "transformer") else hf.model.layers[index]
    attn = layer.attn if hasattr(layer, "attn") else layer.self_attn
    return attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj


def hf_head_logits(hf, ids, hooks):
    """Logits with `op` applied to the input of block `index`'s output projection, per (index, op)."""
    handles = [_out_proj(hf, index).register_forward_pre_hook(lambda m, a, op=op: (op(a[0]), *a[1:]))
               for index, op in hooks]
    try:
        with torch.no_grad():
            return hf(ids).logits
    finally:
        for h in handles:
            h.remove()


def _model(name, generic):
    hf = (FAMILIES[name]() if name in FAMILIES else tiny_model(name)).eval()
    return hf, kw.from_hf(hf, generic=generic)


# native attention (llama GQA, gemma3 QK-norm + window, gpt2, olmo2), generic blocks (forced on mapped
# families, and a mixture-of-experts family only the generic path runs)
HEAD_CASES = [("llama", False), ("gemma3", False), ("gpt2", False), ("olmo2", False),
              ("llama", True), ("gemma3", True), ("mixtral", True)]


@pytest.fixture(scope="module", params=HEAD_CASES, ids=[f"{n}-{'generic' if g else 'native'}" for n, g in HEAD_CASES])
def heads_pair(request):
    return _model(*request.param)


def test_operations_on_heads_match_a_hook_on_the_output_projection(heads_pair):
    hf, lm = heads_pair
    leaf = lm.backbone.get_submodule(inner_calls(lm.backbone, "attn_heads", [1])[1])
    width, size = leaf.site_width("attn_heads"), leaf.head_size
    basis = kw.steer.head_basis(lm, {1: [1], 2: [0, 2]})
    v = _directions(width, 1, 1)[0]
    u = _directions(width, 1, 2)

    def zero(*heads):
        def op(x):
            x = x.clone()
            for h in heads:
                x[..., h * size:(h + 1) * size] = 0
            return x
        return op

    cases = [
        (lm.ablate(basis, site="attn_heads"), [(1, zero(1)), (2, zero(0, 2))]),
        (lm.ablate(basis[1], layers=[1], site="attn_heads", strength=0.5), [(1, lambda x: ref_ablate(x, basis[1], 0.5))]),
        (lm.steer(kw.ControlVector({1: v}, site="attn_heads"), 2.0), [(1, lambda x: ref_add(x, v, 2.0))]),
        (lm.clamp(u, -0.05, 0.05, layers=[0, 2], site="attn_heads"),
         [(i, lambda x: ref_clamp(x, u, -0.05, 0.05)) for i in (0, 2)]),
    ]
    plain = hf_head_logits(hf, IDS, [])
    for model, hooks in cases:
        want = hf_head_logits(hf, IDS, hooks)
        assert (want - plain).abs().max() > 1e-3  # the operation does something here
        torch.testing.assert_close(model(IDS), want, atol=2e-4, rtol=2e-4)
    assert torch.equal(lm(IDS), plain.float()) or torch.allclose(lm(IDS), plain, atol=1e-4)  # lm untouched


GENERIC = ["llama", "gemma3", "mixtral"]  # pre-norm; sandwich norms; mixture of experts


@pytest.fixture(scope="module", params=GENERIC)
def generic_pair(request):
    return _model(request.param, True)


@pytest.mark.parametrize("site", INNER)
def test_generic_blocks_have_every_site_and_match_transformers_hooks(generic_pair, site):
    hf, lm = generic_pair
    assert lm.backbone.layers[1].inner_sites == (*INNER, "attn_heads")
    width = lm.head.weight.shape[1]
    v, d, u = _directions(width, 1, 3)[0], _directions(width, 2, 4), _directions(width, 1, 5)
    cases = [
        (lm.steer(kw.ControlVector({1: v}), 1.5, site=site), [(1, site, lambda x: ref_add(x, v, 1.5))]),
        (lm.ablate(d, layers=[0, 2], site=site), [(i, site, lambda x: ref_ablate(x, d)) for i in (0, 2)]),
        (lm.clamp(u, 0.1, 0.1, layers=[2], site=site), [(2, site, lambda x: ref_clamp(x, u, 0.1, 0.1))]),
    ]
    plain = hf_logits(hf, IDS, [])
    for model, hooks in cases:
        want = hf_logits(hf, IDS, hooks)
        assert (want - plain).abs().max() > 1e-3
        torch.testing.assert_close(model(IDS), want, atol=2e-4, rtol=2e-4)


def _mixed(lm):
    width = lm.head.weight.shape[1]
    v, d = _directions(width, 1, 6)[0], _directions(width, 2, 7)
    model = lm.steer(kw.ControlVector({1: v}), 1.5, site="mlp_out")
    model = model.ablate(d, layers=[0, 2], site="resid_mid").ablate(kw.steer.head_basis(lm, {1: [2]}),
                                                                    site="attn_heads", name="heads")
    return model


def test_cached_generation_and_batched_rows_equal_the_uncached_rollout(generic_pair):
    _, lm = generic_pair
    model = _mixed(lm)
    assert model.generate(IDS, max_new_tokens=8, ignore_eos=True)[0].tolist() == _rollout(model, IDS, 8)
    rows = {"steer_strength": torch.tensor([1.5, 0.0, -1.0]), "ablate_strength": torch.tensor([1.0, 0.0, 0.0]),
            "heads_strength": torch.tensor([1.0, 0.0, 1.0])}
    batch = model.generate(IDS.expand(3, -1), max_new_tokens=6, ignore_eos=True, inputs=rows)
    for r in range(3):
        alone = model.generate(IDS, max_new_tokens=6, ignore_eos=True, inputs={k: t[r:r + 1] for k, t in rows.items()})
        assert batch[r].tolist() == alone[0].tolist(), r
    assert batch[1].tolist() == lm.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist()


def test_native_head_edits_cache_batch_and_stack():
    hf, lm = _model("gemma3", False)
    attn = lm.backbone.layers[1].self_attn
    size, v = attn.head_dim, _directions(attn.site_width("attn_heads"), 1, 8)[0]
    model = lm.ablate(kw.steer.head_basis(lm, {1: [0]}), site="attn_heads") \
        .steer(kw.ControlVector({1: v}, site="attn_heads"), 3.0)
    assert model.generate(IDS, max_new_tokens=8, ignore_eos=True)[0].tolist() == _rollout(model, IDS, 8)

    def op(x):  # the ablation first, then the vector: the order given
        x = x.clone()
        x[..., :size] = 0
        return x + 3.0 * v

    torch.testing.assert_close(model(IDS), hf_head_logits(hf, IDS, [(1, op)]), atol=2e-4, rtol=2e-4)
    rows = {"ablate_strength": torch.tensor([1.0, 0.0]), "steer_strength": torch.tensor([0.0, 3.0])}
    batch = model.generate(IDS.expand(2, -1), max_new_tokens=6, ignore_eos=True, inputs=rows)
    for r in range(2):
        alone = model.generate(IDS, max_new_tokens=6, ignore_eos=True, inputs={k: t[r:r + 1] for k, t in rows.items()})
        assert batch[r].tolist() == alone[0].tolist(), r


def test_a_head_edit_exports_to_onnx_and_generates_as_eager(tmp_path):
    pytest.importorskip("onnxruntime")
    from .tokenizers_for_tests import char_level

    lm = kw.from_hf(FAMILIES["llama"](vocab_size=100))
    lm.tokenizer = char_level()
    model = lm.ablate(kw.steer.head_basis(lm, {1: [1], 2: [0]}), site="attn_heads", name="heads")
    path = tmp_path / "heads.onnx"
    kw.export(model, path, max_length=48)
    onnx_lm = kw.load_exported(path)
    prompts = ["Hello there", "A"]
    assert onnx_lm.generate(prompts, max_new_tokens=6) == model.generate(prompts, max_new_tokens=6)
    rows = {"heads_strength": torch.tensor([0.0, 1.0])}
    want = model.generate(prompts, max_new_tokens=6, inputs=rows)
    assert onnx_lm.generate(prompts, max_new_tokens=6, inputs=rows) == want


# -- bad input --------------------------------------------------------------------------------------------

def test_a_generic_block_without_a_site_says_which_it_has():
    _, lm = _model("granite", True)  # its residual multiplier: the writes are not the modules' outputs
    with pytest.raises(ValueError, match=r"has no site 'attn_out'; its sites are \['resid_pre', 'block_out', "
                                         r"'attn_heads'\]"):
        lm.steer(kw.ControlVector({1: torch.ones(64)}), site="attn_out")


def test_bad_head_input_is_refused_by_name():
    _, lm = _model("llama", False)
    with pytest.raises(ValueError, match=r"heads \[4\] must be distinct indices in \[0, 4\)"):
        kw.steer.head_basis(lm, {1: [4]})
    width = lm.backbone.layers[0].self_attn.site_width("attn_heads")
    with pytest.raises(ValueError, match=rf"width {width + 1} does not fit this model's heads' width .* {width} at"):
        lm.ablate(torch.ones(width + 1), site="attn_heads")
    with pytest.raises(ValueError, match="the gate's probe at .* comes after the gated operation inside "
                                         "'layers.1.self_attn'"):
        lm.ablate(kw.steer.head_basis(lm, {1: [0]}), site="attn_heads",
                  gate=kw.Gate(torch.ones(lm.head.weight.shape[1]), layer=2, site="resid_pre"))


@pytest.mark.parametrize("site", ["attn_heads", "resid_mid"])
def test_training_reads_sites_inside_calls_as_the_native_graph_does(site):
    """A vector trained at a site inside one-call layers (generic blocks; attention's heads) == the
    same training on the native decoder of the same weights (its graph's taps, or for the heads the
    same inner read)."""
    from .tokenizers_for_tests import char_level

    hf = FAMILIES["llama"](vocab_size=100).eval()
    native, generic = kw.from_hf(hf), kw.from_hf(hf, generic=True)
    native.tokenizer = generic.tokenizer = char_level()
    pos, neg = ["good day", "happy to see", "lovely"], ["bad day", "sad to see", "awful"]
    want = kw.ControlVector.train(native, pos, neg, layers=[1, 2], method="mean_diff", site=site, progress=False)
    got = kw.ControlVector.train(generic, pos, neg, layers=[1, 2], method="mean_diff", site=site, progress=False)
    assert got.site == site and sorted(got.directions) == [1, 2]
    for i in (1, 2):
        torch.testing.assert_close(got.directions[i], want.directions[i], atol=1e-4, rtol=1e-4)
    if site == "attn_heads":  # the heads' width, not the hidden size
        assert got.directions[1].numel() == native.backbone.layers[1].self_attn.site_width("attn_heads")
        hf_states = []
        h = _out_proj(hf, 1).register_forward_pre_hook(lambda m, a: hf_states.append(a[0][0, -1]))
        with torch.no_grad():
            for text in pos + neg:
                hf(torch.tensor([native.tokenizer.encode(text)]))
        h.remove()
        d = torch.stack(hf_states[:3]) - torch.stack(hf_states[3:])
        u = d.mean(0) / d.mean(0).norm()
        torch.testing.assert_close(got.directions[1], u * (d @ u).mean(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, generic, site", [("llama", False, "attn_heads"), ("gemma3", True, "attn_heads"),
                                                 ("llama", True, "resid_mid"), ("gemma3", True, "mlp_out")])
def test_gated_operations_inside_calls_match_hooks(name, generic, site):
    """A probe at block 0's output gates an operation inside block 2's call: the same as hooks
    computing the gate there and scaling the operation by it; cached == uncached; a per-row threshold."""
    from .test_steer_ops import hook_site

    hf, lm = _model(name, generic)
    width = lm.head.weight.shape[1]
    w = _directions(width, 1, 12)[0]
    target = lm.backbone.get_submodule(inner_calls(lm.backbone, site, [2])[2]) if site == "attn_heads" else None
    d = _directions(target.site_width(site) if target else width, 1, 13)[0]
    gate = kw.Gate(w, layer=0, threshold=0.0, sharpness=2.0)
    model = lm.ablate(d, layers=[2], site=site, gate=gate)
    seen = {}

    def probe(m, a, o):
        h = o[0] if isinstance(o, tuple) else o
        seen["g"] = torch.sigmoid(2.0 * (h @ w))[..., None]

    def op(x):
        return x - seen["g"] * ref_ablate(x, d, 1.0).sub(x).neg()

    layers = hf.model.layers
    handles = [layers[0].register_forward_hook(probe)]
    if site == "attn_heads":
        handles.append(_out_proj(hf, 2).register_forward_pre_hook(lambda m, a: (op(a[0]), *a[1:])))
    else:
        handles += hook_site(hf, 2, site, op)
    try:
        with torch.no_grad():
            want = hf(IDS).logits
    finally:
        for h in handles:
            h.remove()
    assert (want - hf(IDS).logits).abs().max() > 1e-3
    torch.testing.assert_close(model(IDS), want, atol=2e-4, rtol=2e-4)
    assert model.generate(IDS, max_new_tokens=6, ignore_eos=True)[0].tolist() == _rollout(model, IDS, 6)
    shut = model.generate(IDS, max_new_tokens=6, ignore_eos=True, return_logprobs=True,
                          inputs={"gate_threshold": torch.tensor([1e9])})  # a shut gate: the unsteered model
    plain = lm.generate(IDS, max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    assert shut.tokens == plain.tokens
    torch.testing.assert_close(torch.tensor(shut.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=1e-5)
