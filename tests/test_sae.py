"""SAE feature steering: SAELens folders read (both config layouts), hook names placed at sites, the
edit == the same edit written with transformers hooks and the full SAE, re-encoding sees the set
value, cached == uncached, rows with their own values == each alone, bad input refused."""
import json

import pytest
import torch
from safetensors.torch import save_file

import kvwire as kw
from kvwire.steer.sae import SAE, SAEEdit, hook_site, steer_features

from .conftest import FAMILIES
from .test_guards import _rollout

IDS = torch.tensor([[3, 17, 42, 9, 55, 23, 7, 61]])
WIDTH, FEATURES = 32, 96  # the tiny models' hidden size; an SAE 3x wider


# -- SAEs in SAELens's on-disk format -------------------------------------------------------------------------

def random_sae(seed=0, width=WIDTH, features=FEATURES, jumprelu=False):
    """Weights of a random SAE: about half its features fire on the tiny models' hidden states."""
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(width, features, generator=g) / width ** 0.5,
         "b_enc": torch.randn(features, generator=g) * 0.3,
         "W_dec": torch.randn(features, width, generator=g) / width ** 0.5,
         "b_dec": torch.randn(width, generator=g) * 0.5}
    if jumprelu:
        w["threshold"] = torch.rand(features, generator=g)
    return w


def orthogonal_sae(seed=0, features=16):
    """Unit decoder rows, orthogonal, W_enc = W_dec^T: editing feature i moves no other feature's
    pre-activation. Feature 3 is planted always on (a large encoder bias)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(WIDTH, features, generator=g))  # (D, F) orthonormal columns
    b_enc = torch.randn(features, generator=g) * 0.3
    b_enc[3] = 100.0
    return {"W_enc": q.contiguous(), "b_enc": b_enc, "W_dec": q.T.contiguous(), "b_dec": torch.zeros(WIDTH)}


def write_sae(folder, weights, hook_name="blocks.1.hook_resid_post", layout="v6", apply_b_dec_to_input=True, **cfg):
    """`folder` as SAELens writes it: 6.x (hook under metadata) or pre-6 (hook at top level)."""
    folder.mkdir(parents=True, exist_ok=True)
    width, features = weights["W_enc"].shape
    arch = "jumprelu" if "threshold" in weights else "standard"
    common = {"architecture": arch, "d_in": width, "d_sae": features, "dtype": "float32", "device": "cpu",
              "apply_b_dec_to_input": apply_b_dec_to_input, "normalize_activations": "none"}
    if layout == "v6":
        config = {**common, "reshape_activations": "none",
                  "metadata": {"model_name": "tiny", "hook_name": hook_name, "sae_lens_version": "6.12.1",
                               "prepend_bos": True, "context_size": 128}}
    else:
        layer = int(hook_name.split(".")[1]) if hook_name.startswith("blocks.") else None
        config = {**common, "model_name": "tiny", "hook_name": hook_name, "hook_layer": layer,
                  "hook_head_index": None, "activation_fn_str": "relu", "finetuning_scaling_factor": False,
                  "sae_lens_training_version": "3.13.0", "prepend_bos": True, "context_size": 128,
                  "dataset_path": "tiny/text"}
    (folder / "cfg.json").write_text(json.dumps({**config, **cfg}))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "sae_weights.safetensors"))
    return folder


def sae_of(tmp_path, weights, **options):
    return SAE.load(write_sae(tmp_path / "sae", weights, **options))


# -- the reference: the full SAE, in float64 --------------------------------------------------------------

def ref_edit(sae, x, features, mode):
    """x + (f' - f) @ W_dec over all F features, f encoded as SAELens does."""
    xd = x.double()
    w_enc, b_enc, w_dec, b_dec = (t.double() for t in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec))
    pre = (xd - b_dec * sae.apply_b_dec_to_input) @ w_enc + b_enc
    threshold = 0.0 if sae.threshold is None else sae.threshold.double()
    f = pre.clamp(min=0) * (pre > threshold)
    g = f.clone()
    for i, v in features.items():
        g[..., i] = {"set": lambda: torch.full_like(f[..., i], v), "add": lambda: f[..., i] + v,
                     "clamp": lambda: f[..., i].clamp(v[0], v[1])}[mode]()
    return (xd + (g - f) @ w_dec).to(x.dtype)


def hooked(hf, layer, site, op):
    """Install a transformers hook applying `op` at `site` of decoder layer `layer`; the handle."""
    block = hf.transformer.h[layer] if hasattr(hf, "transformer") else hf.model.layers[layer]

    def first(out):
        return (op(out[0]), *out[1:]) if isinstance(out, tuple) else op(out)

    if site == "resid_pre":
        def pre(module, args, kwargs):
            if args:
                return (op(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": op(kwargs["hidden_states"])}
        return block.register_forward_pre_hook(pre, with_kwargs=True)
    sub = {"block_out": block, "attn_out": getattr(block, "self_attn", None), "mlp_out": block.mlp}[site]
    return sub.register_forward_hook(lambda module, args, out: first(out))


# -- reading the format -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["v6", "v5"])
def test_load_reads_saelens_folders(tmp_path, layout):
    weights = random_sae(jumprelu=True)
    sae = sae_of(tmp_path, weights, hook_name="blocks.2.hook_mlp_out", layout=layout, apply_b_dec_to_input=False)
    for key, t in weights.items():
        assert torch.equal(getattr(sae, key), t), key
    assert (sae.d_in, sae.d_sae, sae.architecture) == (WIDTH, FEATURES, "jumprelu")
    assert sae.apply_b_dec_to_input is False and sae.location() == ("mlp_out", 2)
    x = torch.randn(2, 5, WIDTH)
    torch.testing.assert_close(sae.decode(sae.encode(x)), _plain(sae, x), atol=1e-5, rtol=1e-5)
    # SAELens 3-4: "hook_point", no architecture field
    folder = write_sae(tmp_path / "old", random_sae(), layout="v5", hook_point="blocks.0.hook_resid_pre")
    cfg = json.loads((folder / "cfg.json").read_text())
    for key in ("hook_name", "hook_layer", "architecture"):
        cfg.pop(key)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    old_sae = SAE.load(folder)
    assert old_sae.location() == ("resid_pre", 0) and old_sae.threshold is None and old_sae.apply_b_dec_to_input


def _plain(sae, x):
    """SAELens's forward written out: decode(encode(x)), float64."""
    xd = x.double()
    pre = (xd - sae.b_dec.double() * sae.apply_b_dec_to_input) @ sae.W_enc.double() + sae.b_enc.double()
    f = pre.clamp(min=0) * (pre > (0.0 if sae.threshold is None else sae.threshold.double()))
    return (f @ sae.W_dec.double() + sae.b_dec.double()).float()


@pytest.mark.parametrize("name, place", [
    ("blocks.0.hook_resid_pre", ("resid_pre", 0)), ("blocks.3.hook_resid_mid", ("resid_mid", 3)),
    ("blocks.11.hook_resid_post", ("block_out", 11)), ("blocks.2.hook_attn_out", ("attn_out", 2)),
    ("blocks.2.hook_mlp_out", ("mlp_out", 2)), ("model.layers.5", ("block_out", 5)),
    ("model.layers.5.output", ("block_out", 5)), ("model.language_model.layers.7", ("block_out", 7)),
    ("transformer.h.1", ("block_out", 1))])
def test_hook_names_map_to_sites(name, place):
    assert hook_site(name) == place


@pytest.mark.parametrize("name", ["blocks.1.attn.hook_z", "hook_embed", "blocks.1.hook_mlp_in", "model.layers.2.mlp",
                                  "blocks.x.hook_resid_post"])
def test_unknown_hook_names_are_refused_with_the_patterns(name):
    with pytest.raises(ValueError, match=rf"SAE hook_name '{name}' is not a hook kvwire can place; supported: "
                                         r"blocks.\{L\}.hook_resid_pre, .*model.layers.\{L\}\[.output\].*"
                                         r"Pass site= and layer= to place it yourself"):
        hook_site(name)


# -- the edit -------------------------------------------------------------------------------------------

CASES = [("llama", "block_out", "set", {5: 2.0, 40: 0.0}),
         ("llama", "resid_pre", "clamp", {5: (0.2, 0.4), 9: (None, 0.0)}),
         ("llama", "attn_out", "add", {5: -3.0}), ("llama", "mlp_out", "set", {70: 1.5}),
         ("gpt2", "block_out", "clamp", {5: (1.0, None), 40: (0.0, 0.1)})]


@pytest.mark.parametrize("family, site, mode, features", CASES)
def test_edit_equals_a_transformers_hook_with_the_full_sae(tmp_path, family, site, mode, features):
    hf = FAMILIES[family]()
    lm = kw.from_hf(hf)
    sae = sae_of(tmp_path, random_sae(jumprelu=mode == "clamp"), hook_name="blocks.1.hook_resid_pre")
    edited = steer_features(lm, sae, features, mode=mode, site=site)  # layer 1 from the hook name
    handle = hooked(hf, 1, site, lambda x: ref_edit(sae, x, features, mode))
    try:
        want = hf(IDS).logits
    finally:
        handle.remove()
    torch.testing.assert_close(edited(IDS), want, atol=1e-4, rtol=1e-4)
    assert (edited(IDS) - lm(IDS)).abs().max() > 1e-2  # the edit did something


def test_setting_a_feature_moves_that_feature_only(tmp_path):
    lm = kw.from_hf(FAMILIES["llama"]())
    sae = sae_of(tmp_path, orthogonal_sae())
    edited = steer_features(lm, sae, {3: 7.5, 6: 0.0})
    [inserted] = edited.backbone.meta["kvwire_inserted"]
    _, before = kw.tap(lm.backbone, "layers.1.block_out", depth="layer")(IDS)
    _, after = kw.tap(edited.backbone, inserted, depth="layer")(IDS)
    f, g = sae.encode(before["layers.1.block_out"]), sae.encode(after[inserted])
    assert (f[..., 3] > 0).all() and (f[..., 6] > 0).any()  # planted on; feature 6 fires somewhere
    torch.testing.assert_close(g[..., 3], torch.full_like(g[..., 3], 7.5), atol=1e-4, rtol=0)
    assert g[..., 6].abs().max() < 1e-5  # set to 0: wherever it fired, it no longer does
    others = [j for j in range(sae.d_sae) if j not in (3, 6)]
    torch.testing.assert_close(g[..., others], f[..., others], atol=1e-4, rtol=0)
    assert (f[..., others] > 0).any()
    torch.testing.assert_close(lm.steer_features(sae, {3: 7.5, 6: 0.0})(IDS), edited(IDS))  # the method


def test_only_the_chosen_features_are_kept(tmp_path):
    sae = sae_of(tmp_path, random_sae())
    edit = SAEEdit(sae, {5: 1.0, 9: 2.0, 60: 0.0})
    assert {k: tuple(b.shape) for k, b in edit.named_buffers()} == {
        "dec": (3, WIDTH), "enc": (WIDTH, 3), "bias": (3,), "threshold": (3,), "values": (3,)}
    assert {k for k, _ in SAEEdit(sae, {5: 1.0}, mode="add").named_buffers()} == {"dec", "values"}


def test_jumprelu_threshold_and_b_dec_are_honoured():
    # one feature reading x_0 (W_enc = e_0), writing e_1; pre = x_0 - b_dec_0 * apply + b_enc
    w_enc, w_dec = torch.zeros(4, 1), torch.zeros(1, 4)
    w_enc[0, 0], w_dec[0, 1] = 1.0, 1.0
    x = torch.tensor([[[0.8, 0.0, 0.0, 0.0], [1.6, 0.0, 0.0, 0.0]]])  # (1, 2, 4)

    def moved(threshold, apply_b_dec):
        sae = SAE(w_enc, torch.tensor([0.1]), w_dec, torch.tensor([0.5, 0, 0, 0]),
                  threshold=None if threshold is None else torch.tensor([threshold]), apply_b_dec_to_input=apply_b_dec)
        return SAEEdit(sae, {0: 5.0})(x)[0, :, 1].tolist()  # what the edit added along e_1

    # pre = 0.9, 1.7 (b_dec not subtracted) or 0.4, 1.2 (subtracted); set to 5 adds 5 - f
    assert moved(None, False) == pytest.approx([5 - 0.9, 5 - 1.7])
    assert moved(None, True) == pytest.approx([5 - 0.4, 5 - 1.2])
    assert moved(1.0, False) == pytest.approx([5.0, 5 - 1.7])  # 0.9 <= 1: off, so f = 0
    assert moved(1.0, True) == pytest.approx([5.0, 5 - 1.2])
    assert moved(1.5, True) == pytest.approx([5.0, 5.0])


# -- through the cache and the batch --------------------------------------------------------------------

@pytest.mark.parametrize("mode, features", [("set", {5: 3.0}), ("clamp", {5: (0.0, 0.1), 40: (0.5, 0.6)})])
def test_cached_generation_equals_uncached_rollout(tmp_path, mode, features):
    lm = kw.from_hf(FAMILIES["gemma3"]())
    edited = steer_features(lm, sae_of(tmp_path, random_sae(jumprelu=True)), features, mode=mode)
    got = edited.generate(IDS, max_new_tokens=8, ignore_eos=True)
    assert got[0].tolist() == _rollout(edited, IDS, 8)
    assert got[0].tolist() != lm.generate(IDS, max_new_tokens=8, ignore_eos=True)[0].tolist()


def test_the_schedule_picks_the_positions(tmp_path):
    hf = FAMILIES["llama"]()
    lm = kw.from_hf(hf)
    sae = sae_of(tmp_path, random_sae())
    prompt = IDS[:, :5]

    def at(start, end):  # the reference edit at positions start <= p < end only
        def op(x):
            stop = x.shape[1] if end is None else end
            return torch.cat([x[:, :start], ref_edit(sae, x[:, start:stop], {5: 4.0}, "set"), x[:, stop:]], 1)
        return op

    window = steer_features(lm, sae, {5: 4.0}, when=(2, 5))
    handle = hooked(hf, 1, "block_out", at(2, 5))
    try:
        torch.testing.assert_close(window(IDS), hf(IDS).logits, atol=1e-4, rtol=1e-4)
        handle.remove()
        handle = hooked(hf, 1, "block_out", at(prompt.shape[1], None))  # generated tokens only
        seq = prompt
        for _ in range(6):
            seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    finally:
        handle.remove()
    later = steer_features(lm, sae, {5: 4.0}, when="generated")
    assert later.generate(prompt, max_new_tokens=6, ignore_eos=True)[0].tolist() == seq[0, 5:].tolist()
    assert seq[0, 5:].tolist() != lm.generate(prompt, max_new_tokens=6, ignore_eos=True)[0].tolist()


def test_rows_with_their_own_values_equal_each_alone(tmp_path):
    lm = kw.from_hf(FAMILIES["llama"]())
    sae = sae_of(tmp_path, random_sae())
    rows = [torch.tensor([3, 17, 42, 9, 55]), torch.tensor([8, 2, 61])]  # left padding for the second
    edited = steer_features(lm, sae, {5: 0.0, 40: 1.0}, layer=2)
    assert list(edited.cached.runtime_inputs) == ["sae_f5", "sae_f40", "sae_start", "sae_end"]
    values = {"sae_f5": torch.tensor([6.0, -4.0]), "sae_f40": torch.tensor([1.0, 8.0])}
    mixed = edited.generate(rows, max_new_tokens=6, ignore_eos=True, inputs=values)
    alone = [steer_features(lm, sae, {5: a, 40: b}, layer=2).generate(r, max_new_tokens=6, ignore_eos=True)
             for r, a, b in zip(rows, values["sae_f5"].tolist(), values["sae_f40"].tolist())]
    assert [m.tolist() for m in mixed] == [a.tolist() for a in alone]
    assert alone[0].tolist() != lm.generate(rows[0], max_new_tokens=6, ignore_eos=True).tolist()


def test_clamp_bounds_are_runtime_inputs_per_row(tmp_path):
    lm = kw.from_hf(FAMILIES["llama"]())
    sae = sae_of(tmp_path, random_sae())
    edited = steer_features(lm, sae, {5: (0.0, 0.0)}, mode="clamp", name="hold")
    assert list(edited.cached.runtime_inputs) == ["hold_f5_lo", "hold_f5_hi", "hold_start", "hold_end"]
    wide = {"hold_f5_lo": torch.tensor([0.0, 2.0]), "hold_f5_hi": torch.tensor([0.0, 2.5])}
    mixed = edited.generate(IDS.repeat(2, 1), max_new_tokens=5, ignore_eos=True, inputs=wide)
    assert mixed[0].tolist() == edited.generate(IDS, max_new_tokens=5, ignore_eos=True)[0].tolist()
    other = steer_features(lm, sae, {5: (2.0, 2.5)}, mode="clamp")
    assert mixed[1].tolist() == other.generate(IDS, max_new_tokens=5, ignore_eos=True)[0].tolist()


# -- bad input ------------------------------------------------------------------------------------------

def test_bad_steering_input_is_refused(tmp_path):
    lm = kw.from_hf(FAMILIES["llama"]())
    sae = sae_of(tmp_path, random_sae())
    with pytest.raises(ValueError, match=r"the SAE reads vectors of width 48 \(d_in\) but this model's hidden "
                                         r"size is 32"):
        steer_features(lm, SAE(**random_sae(width=48)), {1: 1.0}, layer=1, site="block_out")
    with pytest.raises(ValueError, match=r"feature index 96 is out of range: this SAE has 96 features \(0 to 95\)"):
        steer_features(lm, sae, {96: 1.0})
    with pytest.raises(ValueError, match=r"feature index -1 is out of range"):
        steer_features(lm, sae, {-1: 1.0})
    with pytest.raises(TypeError, match=r"feature indices must be ints, got '3' \(str\)"):
        steer_features(lm, sae, {"3": 1.0})
    with pytest.raises(ValueError, match=r"feature 3: value must be finite, got nan"):
        steer_features(lm, sae, {3: float("nan")})
    with pytest.raises(ValueError, match=r"feature 3: value must be finite, got inf"):
        steer_features(lm, sae, {3: float("inf")}, mode="add")
    with pytest.raises(ValueError, match=r"feature 3: hi must be finite, got -inf"):
        steer_features(lm, sae, {3: (None, float("-inf"))}, mode="clamp")
    with pytest.raises(ValueError, match=r"feature 3: clamp range is inverted: lo 2.0 > hi 1.0; expected lo <= hi"):
        steer_features(lm, sae, {3: (2.0, 1.0)}, mode="clamp")
    with pytest.raises(ValueError, match=r"feature 3: clamp takes a \(lo, hi\) pair \(None: unbounded\), got 1.0"):
        steer_features(lm, sae, {3: 1.0}, mode="clamp")
    with pytest.raises(TypeError, match=r"feature 3: value must be a number, got \(1.0, 2.0\)"):
        steer_features(lm, sae, {3: (1.0, 2.0)})
    with pytest.raises(ValueError, match=r"mode must be one of \('set', 'add', 'clamp'\), got 'scale'"):
        steer_features(lm, sae, {3: 1.0}, mode="scale")
    with pytest.raises(TypeError, match=r"features must be a non-empty \{feature index: value\} dict, got \{\}"):
        steer_features(lm, sae, {})
    with pytest.raises(TypeError, match=r"sae must be a kvwire SAE \(SAE.load\(folder\)\), got dict"):
        steer_features(lm, random_sae(), {3: 1.0})
    with pytest.raises(ValueError, match=r"the SAE steers blocks \[7\], but this model has blocks 0-3"):
        steer_features(lm, sae, {3: 1.0}, layer=7)
    with pytest.raises(ValueError, match=r"site must be one of .*got 'resid_post'"):
        steer_features(lm, sae, {3: 1.0}, site="resid_post")
    taken = steer_features(lm, sae, {3: 1.0})
    with pytest.raises(ValueError, match=r"already has runtime inputs named 'sae' \(mode='set', features=\{3: 1.0\}"):
        steer_features(taken, sae, {3: 2.0}, name="sae")
    assert "sae2_f3" in steer_features(taken, sae, {3: 2.0}).cached.runtime_inputs  # after the first, named apart


def test_an_unknown_hook_needs_a_site_and_layer(tmp_path):
    lm = kw.from_hf(FAMILIES["llama"]())
    sae = sae_of(tmp_path, random_sae(), hook_name="blocks.1.attn.hook_z")
    with pytest.raises(ValueError, match=r"SAE hook_name 'blocks.1.attn.hook_z' is not a hook kvwire can place"):
        steer_features(lm, sae, {3: 1.0})
    with pytest.raises(ValueError, match="is not a hook kvwire can place"):
        steer_features(lm, sae, {3: 1.0}, layer=1)  # the site still comes from the hook name
    placed = steer_features(lm, sae, {3: 1.0}, site="block_out", layer=1)
    plain = steer_features(lm, sae_of(tmp_path / "b", random_sae()), {3: 1.0})  # blocks.1.hook_resid_post
    torch.testing.assert_close(placed(IDS), plain(IDS))
    mismatch = sae_of(tmp_path / "c", random_sae(), layout="v5", hook_layer=2)
    with pytest.raises(ValueError, match=r"SAE hook_name 'blocks.1.hook_resid_post' is block 1 but hook_layer is 2; "
                                         r"pass layer= to choose"):
        steer_features(lm, mismatch, {3: 1.0})
    torch.testing.assert_close(steer_features(lm, mismatch, {3: 1.0}, layer=1)(IDS), plain(IDS))
    with pytest.raises(ValueError, match=r"SAE hook_name None is not a hook kvwire can place"):
        steer_features(lm, SAE(**random_sae()), {3: 1.0}, layer=1)


@pytest.mark.parametrize("cfg, message", [
    (dict(architecture="topk"), r"architecture 'topk' is not supported; kvwire reads \['standard', 'jumprelu'\] SAEs"),
    (dict(architecture="gated"), r"architecture 'gated' is not supported"),
    (dict(activation_fn_str="topk"), r"activation_fn 'topk' is not supported; kvwire reads ReLU"),
    (dict(normalize_activations="expected_average_only_in"),
     r"normalize_activations is 'expected_average_only_in'; kvwire supports 'none' only"),
    (dict(normalize_activations="layer_norm"), r"normalize_activations is 'layer_norm'; kvwire supports 'none' only"),
    (dict(reshape_activations="hook_z"), r"reshape_activations is 'hook_z'; kvwire edits whole-width sites"),
    (dict(d_sae=128), r"cfg.json: d_sae is 128 but the weights have 96"),
])
def test_unsupported_saes_are_refused_by_name(tmp_path, cfg, message):
    folder = write_sae(tmp_path / "sae", random_sae(), layout="v5", **cfg)
    with pytest.raises(ValueError, match=message):
        SAE.load(folder)


def test_bad_weight_files_are_refused(tmp_path):
    w = random_sae()
    with pytest.raises(ValueError, match=r"missing tensors \['b_dec'\]; unknown tensors \['b_gate'\]"):
        gated = {**{k: v for k, v in w.items() if k != "b_dec"}, "b_gate": w["b_enc"].clone()}
        SAE.load(write_sae(tmp_path / "a", gated))
    with pytest.raises(ValueError, match=r"architecture 'jumprelu' needs a 'threshold' tensor"):
        SAE.load(write_sae(tmp_path / "b", w, architecture="jumprelu"))
    with pytest.raises(ValueError, match=r"scaling_factor is not all ones"):
        SAE.load(write_sae(tmp_path / "c", {**w, "scaling_factor": torch.full((FEATURES,), 2.0)}))
    ones = SAE.load(write_sae(tmp_path / "d", {**w, "scaling_factor": torch.ones(FEATURES)}))
    assert torch.equal(ones.W_enc, w["W_enc"])
    with pytest.raises(ValueError, match=r"W_dec must have shape \(96, 32\) for W_enc of shape \(32, 96\), "
                                         r"got \(32, 96\)"):
        SAE.load(write_sae(tmp_path / "e", {**w, "W_dec": w["W_dec"].T}))
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "cfg.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no sae_weights.safetensors; expected a SAELens SAE folder"):
        SAE.load(tmp_path / "f")
    (tmp_path / "a" / "sae_weights.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"sae_weights.safetensors is not a readable safetensors file"):
        SAE.load(tmp_path / "a")


def test_exported_to_onnx_with_values_per_row(tmp_path):
    pytest.importorskip("onnxruntime")
    lm = kw.from_hf(FAMILIES["llama"]())
    sae = sae_of(tmp_path, random_sae(jumprelu=True))
    both = steer_features(steer_features(lm, sae, {5: 4.0}), sae, {9: (0.0, 0.5)}, mode="clamp", name="hold")
    kw.export(both, tmp_path / "m.onnx", max_length=32)
    runtime = kw.load_exported(tmp_path / "m.onnx")
    rows = [IDS[0, :5], IDS[0, 2:5]]
    values = {"sae_f5": torch.tensor([4.0, 0.0]), "hold_f9_hi": torch.tensor([0.5, 3.0])}
    got = runtime.generate(rows, max_new_tokens=6, ignore_eos=True, inputs=values)
    assert [g.tolist() for g in got] == [g.tolist() for g in both.generate(rows, max_new_tokens=6, ignore_eos=True,
                                                                            inputs=values)]
    second = steer_features(steer_features(lm, sae, {5: 0.0}), sae, {9: (0.0, 3.0)}, mode="clamp")
    assert got[1].tolist() == second.generate(rows[1], max_new_tokens=6, ignore_eos=True).tolist()
