"""Rotary scaling types against transformers' own rotary embeddings (the arbiter), on tiny sizes."""
import pytest
import torch

from kvwire.layers.rope_scaling import check_rope_scaling, resolve_rope_scaling, rope_from_hf
from kvwire.layers.rotary import Rotary
from kvwire.layers.shared import per_call

HEAD_DIM = 16
SHORT, LONG = [1.0, 1.25, 1.5, 2.0], [2.0, 4.0, 8.0, 16.0]  # longrope factors for rotary_dim 8
# (name, rope_parameters, max_position_embeddings, a length past the original context)
LLAMA_CASES = [
    ("default", {"rope_type": "default"}, 64, 100),
    ("linear", {"rope_type": "linear", "factor": 4.0}, 64, 100),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, 64, 100),
    # omp 64, high 4, low 1: wavelengths 6.3 (kept), 20 and 63 (smoothed), 199+ (divided by factor)
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, 256, 200),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192, 3000),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                     "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8, "beta_slow": 2}, 8192, 3000),
    ("yarn-untruncated", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                          "truncate": False, "attention_factor": 1.3}, 8192, 3000),
]


def _hf_sin(signed_sin):
    """kvwire's sin (B, 1, T, rd) has its first half negated; transformers' (B, T, rd) does not."""
    half = signed_sin.shape[-1] // 2
    return torch.cat((-signed_sin[..., :half], signed_sin[..., half:]), dim=-1)[:, 0]


def _llama_rope(rope, mpe):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=HEAD_DIM, num_hidden_layers=1,
                         max_position_embeddings=mpe, rope_parameters={**rope, "rope_theta": 10_000.0})
    return LlamaRotaryEmbedding(config)


def _phi3_rope(rope, partial, mpe=64, omp=16):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=mpe,
                        original_max_position_embeddings=omp, partial_rotary_factor=partial,
                        rope_parameters={**rope, "rope_theta": 10_000.0, "partial_rotary_factor": partial})
    return Phi3RotaryEmbedding(config)


def _assert_tables_match(ours, hf_rope, positions):
    cos, sin = ours.tables(positions)
    hf_cos, hf_sin = hf_rope(torch.zeros(1), positions)
    assert cos.shape == (positions.shape[0], 1, positions.shape[1], ours.rotary_dim)
    torch.testing.assert_close(cos[:, 0], hf_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(_hf_sin(sin), hf_sin, atol=1e-6, rtol=1e-6)


def _positions(mpe_like, beyond):
    """Inside the original context, beyond it, and a decode-like chunk far out (batch of 2)."""
    return [torch.arange(mpe_like // 2)[None], torch.arange(beyond)[None],
            torch.tensor([[beyond - 3, beyond - 2, beyond - 1], [4, 5, 6]])]


@pytest.mark.parametrize("name, rope, mpe, beyond", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_tables_match_transformers_llama(name, rope, mpe, beyond):
    ours = Rotary(HEAD_DIM, 10_000.0, rope, max_position_embeddings=mpe)
    for positions in _positions(mpe, beyond):
        # a fresh transformers module per call: its dynamic type keeps state between calls
        _assert_tables_match(ours, _llama_rope(rope, mpe), positions)
    if "yarn" in name:
        assert ours.attention_factor != 1.0  # the folded-in factor was exercised


@pytest.mark.parametrize("rope", [{"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                                  {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                   "factor": 2.0, "attention_factor": 1.1}], ids=["derived", "explicit"])
def test_longrope_tables_match_transformers_phi3_both_regimes(rope):
    # transformers' Phi3Config puts its top-level original_max_position_embeddings into the rope dict
    ours = Rotary(HEAD_DIM, 10_000.0, dict(rope, original_max_position_embeddings=16), rotary_dim=8,
                  max_position_embeddings=64)
    short, long_ = torch.arange(16)[None], torch.arange(17)[None]  # seq_len 16 = omp: short; 17: long
    for positions in (short, long_, torch.tensor([[20, 21], [0, 1]])):
        _assert_tables_match(ours, _phi3_rope(rope, 0.5), positions)
    assert not torch.allclose(ours.tables(short)[0], ours.tables(long_)[0][..., :16, :], atol=1e-3)
    if "factor" not in rope:  # Phi-3's default: sqrt(1 + log(64/16) / log(16))
        assert ours.attention_factor == pytest.approx(1.5**0.5)


def test_longrope_full_rotary_matches_phi3():
    rope = {"rope_type": "longrope", "short_factor": SHORT * 2, "long_factor": LONG * 2,
            "original_max_position_embeddings": 16}
    ours = Rotary(HEAD_DIM, 10_000.0, rope, max_position_embeddings=64)
    for positions in (torch.arange(10)[None], torch.arange(40)[None]):
        _assert_tables_match(ours, _phi3_rope(rope, 1.0), positions)


@pytest.mark.parametrize("rope, original", [({"rope_type": "default"}, {}),
                                            ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                                             {"original_max_position_embeddings": 16})], ids=["default", "longrope"])
def test_partial_rotary_matches_phi3_apply_rotary_pos_emb(rope, original):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 30, HEAD_DIM, generator=g), torch.randn(2, 1, 30, HEAD_DIM, generator=g)
    positions = torch.arange(30).expand(2, 30)
    ours = Rotary(HEAD_DIM, 10_000.0, {**rope, **original}, rotary_dim=8, max_position_embeddings=64)
    cos, sin = ours.tables(positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, *_phi3_rope(rope, 0.5)(q, positions))
    torch.testing.assert_close(ours.rotate(q, cos, sin), hf_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.rotate(k, cos, sin), hf_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.rotate(q, cos, sin)[..., 8:], q[..., 8:], atol=0, rtol=0)  # passes through


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                   "original_max_position_embeddings": 16}], ids=["dynamic", "longrope"])
def test_length_dependent_types_trace_and_export_without_branching(rope):
    ours = Rotary(HEAD_DIM, 10_000.0, rope, rotary_dim=8, max_position_embeddings=16)
    x = torch.randn(1, 2, 5, HEAD_DIM)
    traced = torch.fx.symbolic_trace(ours)
    T = torch.export.Dim("T", min=2, max=256)
    exported = torch.export.export(ours, (x, torch.arange(5)[None]),
                                   dynamic_shapes=({2: T}, {1: T})).module()
    for length in (5, 40):  # within and beyond the original context of 16: one graph serves both
        x, positions = torch.randn(1, 2, length, HEAD_DIM), torch.arange(length)[None]
        want = ours(x, positions)
        torch.testing.assert_close(traced(x, positions), want, atol=0, rtol=0)
        torch.testing.assert_close(exported(x, positions), want, atol=1e-6, rtol=1e-6)
    # the same five tokens rotate differently inside a call past the original context: the graph chose
    short = exported(x[..., :5, :], positions[:, :5])
    assert not torch.allclose(exported(x, positions)[..., :5, :], short, atol=1e-4)


def test_a_number_keeps_meaning_a_linear_factor():
    positions = torch.arange(7)[None]
    old = 1.0 / (10_000.0 ** (torch.arange(0, 8, 2).float() / 8)) / 4.0  # the former formula
    cos, _ = Rotary(8, 1e4, 4.0).tables(positions)
    torch.testing.assert_close(cos[0, 0, :, :4], (positions[0, :, None] * old).cos(), atol=0, rtol=0)
    torch.testing.assert_close(cos, Rotary(8, 1e4, {"rope_type": "linear", "factor": 4.0}).tables(positions)[0])
    assert Rotary(8, 1e4, 1.0).scaling is None and Rotary(8, 1e4, {"type": "default"}).scaling is None


def test_equal_settings_share_tables_and_any_setting_separates_them():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    long_rope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    positions = torch.arange(5)[None]
    with per_call():
        first = Rotary(16, 1e4, yarn, rotary_dim=8).tables(positions)
        assert Rotary(16, 1e4, dict(yarn), rotary_dim=8).tables(positions) is first
        for other in (Rotary(16, 1e4, {**yarn, "beta_fast": 16}, rotary_dim=8), Rotary(16, 1e4, yarn),
                      Rotary(16, 2e4, yarn, rotary_dim=8),
                      Rotary(16, 1e4, yarn, rotary_dim=8, max_position_embeddings=99),
                      Rotary(16, 1e4, long_rope, rotary_dim=8, max_position_embeddings=64)):  # lists: hashable
            assert other.tables(positions) is not first


def test_meta_build_then_reset_buffers_matches_a_cpu_build():
    rope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    cpu = Rotary(16, 1e4, rope, rotary_dim=8, max_position_embeddings=64)
    with torch.device("meta"):
        meta = Rotary(16, 1e4, rope, rotary_dim=8, max_position_embeddings=64)
    meta.to_empty(device="cpu")
    meta.reset_buffers()
    positions = torch.arange(40)[None]
    torch.testing.assert_close(meta.tables(positions), cpu.tables(positions), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_keeps_the_tables_float32(dtype):
    """`.to(bf16)` would round the frequencies (every angle with them): a cast model's tables are
    a fresh build's, float32, while its tables for a bf16 call are those rounded once at the end."""
    rope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    fresh = Rotary(16, 1e4, rope, rotary_dim=8, max_position_embeddings=64)
    cast = Rotary(16, 1e4, rope, rotary_dim=8, max_position_embeddings=64).to(dtype)
    assert all(getattr(cast, n).dtype == torch.float32 for n in cast._names)
    positions = torch.arange(40)[None]
    torch.testing.assert_close(cast.tables(positions, dtype), fresh.tables(positions, dtype), atol=0, rtol=0)
    torch.testing.assert_close(cast.tables(positions), fresh.tables(positions), atol=0, rtol=0)
    # what the cast did before: the test would see it
    assert any(not torch.equal(getattr(fresh, n).to(dtype).float(), getattr(fresh, n)) for n in fresh._names)


@pytest.mark.parametrize("scaling, rotary_dim, match", [
    ({"rope_type": "ntk"}, None, r"rope_type 'ntk' is not supported; expected one of \['default', 'linear', "
                                 r"'dynamic', 'llama3', 'yarn', 'longrope', 'frequency_factors'\]"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, None, "low_freq_factor is missing; expected"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1", "high_freq_factor": 4.0}, None,
     r"low_freq_factor='1'; expected a finite number > 0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}, None,
     "high_freq_factor=4.0 must be greater than low_freq_factor=4.0"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": LONG}, 8,
     r"short_factor has 3 entries; expected rotary_dim / 2 = 4"),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": "big"}, 8, "long_factor='big'; expected a list"),
    ({"rope_type": "linear", "factor": 0.0}, None, r"factor=0.0; expected a finite number > 0"),
    ({"rope_type": "linear", "factor": -2}, None, r"factor=-2; expected a finite number > 0"),
    ({"rope_type": "dynamic", "factor": float("nan")}, None, r"factor=nan; expected a finite number > 0"),
    ({"rope_type": "yarn", "factor": float("inf")}, None, r"factor=inf; expected a finite number > 0"),
    ({"rope_type": "linear", "factor": True}, None, r"factor=True; expected a finite number > 0"),
    ({"rope_type": "linear"}, None, "factor is missing"),
    ({"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, None, r"truncate='no'; expected True or False"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096.0}, None, "an integer > 0"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, None,
     r"linear: unknown parameter\(s\) \['low_freq_factor'\]; linear takes \['factor'\]"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, None, "rope_theta and partial_rotary_factor are not"),
    ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, None, "rope_type='linear' but type='yarn'"),
    ("linear", None, "rope_scaling must be None, a linear factor or a dict"),
    (0.0, None, "rope scaling factor 0.0; expected a finite number > 0"),
])
def test_invalid_scaling_raises(scaling, rotary_dim, match):
    with pytest.raises(ValueError, match=match):
        check_rope_scaling(scaling, rotary_dim=rotary_dim)


@pytest.mark.parametrize("args, kwargs, match", [
    ((16, 1e4, {"rope_type": "dynamic", "factor": 2.0}), {}, "dynamic needs max_position_embeddings"),
    ((16, 1e4, {"rope_type": "yarn", "factor": 2.0}), {}, "yarn needs original_max_position_embeddings, or max_pos"),
    ((16, 1e4, {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                "original_max_position_embeddings": 16}), {"rotary_dim": 8}, "longrope needs factor, or max_pos"),
    ((16, 1e4, {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}), {"max_position_embeddings": 64},
     "short_factor has 4 entries; expected rotary_dim / 2 = 8"),
    ((16, 1e4), {"rotary_dim": 7}, r"rotary_dim=7 with head_dim=16; expected an even integer in \(0, head_dim\]"),
    ((16, 1e4), {"rotary_dim": 32}, "rotary_dim=32 with head_dim=16"),
    ((16, 0.0), {}, r"rope base \(theta\) 0.0; expected a finite number > 0"),
    ((16, 1e4), {"max_position_embeddings": 0}, "max_position_embeddings=0; expected an integer > 0"),
])
def test_invalid_rotary_settings_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rotary(*args, **kwargs)


def test_normalised_form_and_resolved_defaults():
    s = check_rope_scaling({"type": "yarn", "factor": 4, "beta_fast": None, "original_max_position_embeddings": 32})
    assert s == {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32}
    assert check_rope_scaling(s) == s and check_rope_scaling(tuple(sorted(s.items()))) == s
    p = resolve_rope_scaling(s, 8)
    assert (p["beta_fast"], p["beta_slow"], p["truncate"]) == (32, 1, True)
    assert resolve_rope_scaling({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0}, 8, 128)["original_max_position_embeddings"] == 128


def test_rope_from_hf_reads_v4_and_v5_alike():
    from transformers import LlamaConfig, Phi3Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    v5 = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=256,
                     rope_parameters={**yarn, "rope_theta": 5e5}).to_dict()
    v4 = {"max_position_embeddings": 256, "rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                               "original_max_position_embeddings": 64}}
    assert rope_from_hf(dict(v5)) == rope_from_hf(dict(v4)) == (5e5, yarn, 1.0)
    both = {**v4, "rope_parameters": v5["rope_parameters"]}
    assert rope_from_hf(both) == (5e5, yarn, 1.0) and not {"rope_theta", "rope_scaling", "rope_parameters"} & set(both)
    # Phi-3: partial rotary and the original context at top level (v4), inside rope_parameters (v5)
    rope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    phi_v5 = Phi3Config(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=64,
                        original_max_position_embeddings=16, partial_rotary_factor=0.5,
                        rope_parameters={**rope, "rope_theta": 1e4, "partial_rotary_factor": 0.5}).to_dict()
    phi_v4 = {"max_position_embeddings": 64, "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5,
              "rope_theta": 1e4, "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}
    want = (1e4, check_rope_scaling({**rope, "original_max_position_embeddings": 16}), 0.5)
    assert rope_from_hf(dict(phi_v5)) == rope_from_hf(dict(phi_v4)) == want
    assert rope_from_hf({}) == (10_000.0, None, 1.0)
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None, 1.0)


@pytest.mark.parametrize("d, match", [
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     r"rope_theta=10000.0 but rope_parameters has rope_theta=1000000.0"),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.5 but rope_parameters"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "linear", "factor": 4.0}},
     "disagrees with rope_parameters"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}},
     "disagrees with rope_parameters"),
    ({"original_max_position_embeddings": 16, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                               "original_max_position_embeddings": 32}},
     "original_max_position_embeddings=16 but its rope scaling has 32"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     r"per-layer-type dicts \['full_attention', 'sliding_attention'\]"),
    ({"rope_parameters": "x"}, "rope_parameters='x'; expected a dict"),
])
def test_rope_from_hf_rejects_disagreeing_forms(d, match):
    with pytest.raises(ValueError, match=match):
        rope_from_hf(d)


def test_frequency_factors_divide_the_default_frequencies_and_are_checked():
    """kvwire's own type for GGUF files' rope_freqs (Llama 3.x): default frequencies / factors."""
    factors = [1.0, 2.0, 4.0, 8.0]
    scaled = Rotary(8, 1e4, {"rope_type": "frequency_factors", "frequency_factors": factors})
    plain = Rotary(8, 1e4)
    torch.testing.assert_close(scaled.inv_freq, plain.inv_freq / torch.tensor(factors), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"frequency_factors has 3 entries; expected rotary_dim / 2 = 4"):
        Rotary(8, 1e4, {"rope_type": "frequency_factors", "frequency_factors": factors[:3]})
