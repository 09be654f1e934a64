"""Inputs that used to give silently wrong output or an unhelpful error: each fixed, each pinned."""
import math

import numpy as np
import pytest
import torch

import kvwire as kw
from kvwire.graph.cache import CACHE_DTYPE

from .conftest import FAMILIES
from .tokenizers_for_tests import char_level

IDS = torch.tensor([[3, 17, 42, 9, 55]])


def _rollout(lm, ids, n):
    seq = ids
    for _ in range(n):
        seq = torch.cat([seq, lm(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, ids.shape[1]:].tolist()


def test_stop_token_ids_of_any_integer_form_stop(tiny_lm):
    free = _rollout(tiny_lm, IDS, 6)
    target = free[3]
    first = free.index(target)
    forms = [torch.tensor(target), torch.tensor([target]), [torch.tensor(target)], target, [target],
             np.int64(target), np.array([target]), [np.int32(target)]]
    for stop in forms:  # one model for every form: its cached graph is built once
        got = tiny_lm.generate(IDS[0], max_new_tokens=6, ignore_eos=True, stop_token_ids=stop)
        assert got.tolist() == free[:first], stop
        beam = tiny_lm.generate(IDS[0], max_new_tokens=6, ignore_eos=True, stop_token_ids=stop,
                                sampler=kw.BeamSearch(num_beams=1))
        assert beam.tolist() == free[:first], stop  # one beam is greedy


def test_bad_stop_token_ids(tiny_lm):
    with pytest.raises(TypeError, match=r"stop_token_ids must be integer ids \(0-d or 1-D\), got a torch.float32"):
        tiny_lm.generate(IDS, stop_token_ids=torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"stop_token_ids must be integer token ids, got '7' \(str\)"):
        tiny_lm.generate(IDS, stop_token_ids=["7"])
    with pytest.raises(ValueError, match=r"stop token id 500 is outside the vocabulary \[0, 96\)"):
        tiny_lm.generate(IDS, stop_token_ids=[500])
    with pytest.raises(TypeError, match="stop_token_ids must be an int, a list of ints or an integer tensor; got bool"):
        tiny_lm.generate(IDS, stop_token_ids=True)


def test_repetition_penalty_changes_beam_search_as_in_transformers(family):
    hf = FAMILIES[family]()
    lm = kw.from_hf(hf)
    beam = kw.BeamSearch(num_beams=3)
    plain = lm.generate(IDS, max_new_tokens=8, ignore_eos=True, sampler=beam)[0].tolist()
    penalised = lm.generate(IDS, max_new_tokens=8, ignore_eos=True, sampler=beam, repetition_penalty=3.0)[0].tolist()
    assert penalised != plain
    with torch.no_grad():
        want = hf.generate(IDS, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False,
                           repetition_penalty=3.0, attention_mask=torch.ones_like(IDS), pad_token_id=0,
                           eos_token_id=None, early_stopping=False, length_penalty=1.0)
    assert penalised == want[0, IDS.shape[1]:].tolist()


def test_non_finite_logits_raise_naming_step_and_row(tiny_lm):
    width = tiny_lm.head.weight.shape[1]
    huge = tiny_lm.steer(kw.ControlVector({1: torch.full((width,), 1e38)}), torch.tensor([0.0, 1e10]))
    with pytest.raises(FloatingPointError, match=r"non-finite logits \(nan\) in row 1 at generation step 0 "
                                                 r"\(after the prompt\)"):
        huge.generate(IDS.repeat(2, 1), max_new_tokens=4, ignore_eos=True)
    late = tiny_lm.steer(kw.ControlVector({1: torch.full((width,), 1e38)}), 1e10, generated_only=True)
    with pytest.raises(FloatingPointError, match=r"in row 0 at generation step 1 \(after 1 generated token\)"):
        late.generate(IDS, max_new_tokens=4, ignore_eos=True)
    second = tiny_lm.steer(kw.ControlVector({1: torch.full((width,), 1e38)}), torch.tensor([0.0, 1e10]),
                           generated_only=True)
    with pytest.raises(FloatingPointError, match=r"in row 1 \(beam 0\) at generation step 1"):  # the prompt, not b*n+k
        second.generate(IDS.repeat(2, 1), max_new_tokens=4, ignore_eos=True, sampler=kw.BeamSearch(num_beams=3))


def test_a_broken_weight_raises_instead_of_producing_tokens(family):
    lm = kw.from_hf(FAMILIES[family]())
    with torch.no_grad():
        next(p for n, p in lm.backbone.named_parameters() if p.dim() == 2 and "emb" not in n and "wte" not in n)[0, 0] = \
            float("nan")
    with pytest.raises(FloatingPointError, match=r"non-finite logits \(nan\) in row 0 at generation step 0"):
        lm.generate(IDS, max_new_tokens=3, sampler=kw.TopP(0.9), seed=0)


def test_gemma3_float16_keeps_a_float32_residual_past_float16s_range():
    hf = FAMILIES["gemma3"]()
    with torch.no_grad():
        # embeddings of +-6.2e4 (float16 holds up to 65504) to which every block adds up to ~1e4:
        # the residual leaves float16's range while every layer's own output stays inside it
        emb = hf.model.embed_tokens.weight
        emb.copy_(torch.sign(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))) * 1.1e4)
        for layer in hf.model.layers:
            layer.post_feedforward_layernorm.weight.fill_(2e3)
        hf.model.norm.weight.fill_(-0.99)  # (1 + w) = 0.01: tied-head logits stay small
    full, half = kw.from_hf(hf), kw.from_hf(hf, dtype=torch.float16)
    want = full(IDS)
    assert want.isfinite().all() and next(half.parameters()).dtype == torch.float16
    got = half(IDS)
    assert got.dtype == torch.float16 and got.isfinite().all()
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    gen = half.generate(IDS, max_new_tokens=4, ignore_eos=True)[0].tolist()
    assert gen == _rollout(half, IDS, 4)  # the cached graph keeps the float32 residual too
    later = kw.from_hf(hf).edit(kw.skip("layers.1"))
    later.cached  # traced in float32, then converted: the residual still stays float32
    later.half()
    assert later(IDS).isfinite().all() and later.generate(IDS, max_new_tokens=2, ignore_eos=True)[0].shape == (2,)


def test_a_tiny_temperature_samples_the_top_token(tiny_lm):
    greedy = tiny_lm.generate(IDS, max_new_tokens=5, ignore_eos=True)[0]
    for sampler in (kw.Random(temperature=1e-45), kw.TopK(5, temperature=1e-45), kw.TopP(0.9, temperature=1e-45)):
        assert torch.equal(tiny_lm.generate(IDS, max_new_tokens=5, ignore_eos=True, sampler=sampler, seed=0)[0], greedy)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        kw.Random(temperature=math.inf)


def test_beam_early_stopping_settings():
    with pytest.raises(ValueError, match=r"early_stopping must be True, False or 'never' \(as transformers\), got 'nevr'"):
        kw.BeamSearch(early_stopping="nevr")
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'.*got 1"):
        kw.BeamSearch(early_stopping=1)
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
        kw.BeamSearch(early_stopping=np.bool_(True))  # would have run as False
    with pytest.raises(ValueError, match="length_penalty must be a finite number, got True"):
        kw.BeamSearch(length_penalty=True)


@pytest.mark.parametrize("setting", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0])
def test_beam_search_settings_match_transformers(setting, length_penalty):
    hf = FAMILIES["gpt2"](seed=3, vocab_size=24)  # a small vocabulary: beams finish (end token 1) early
    lm = kw.from_hf(hf)
    got = lm.generate(IDS % 24, max_new_tokens=10, sampler=kw.BeamSearch(4, length_penalty, setting))[0].tolist()
    with torch.no_grad():
        want = hf.generate(IDS % 24, max_new_tokens=10, num_beams=4, do_sample=False, early_stopping=setting,
                           length_penalty=length_penalty, attention_mask=torch.ones_like(IDS), pad_token_id=0,
                           eos_token_id=1)
    want = want[0, IDS.shape[1]:].tolist()
    assert got == (want[:-1] if want[-1] == 1 else want)  # kvwire does not return the end token


def test_uncached_calls_check_shape_vocabulary_and_context(family):
    lm = kw.from_hf(FAMILIES[family](vocab_size=100))
    with pytest.raises(ValueError, match=r"lm\(token_ids\) expects a \(B, T\) tensor, got shape \(5,\); use ids\[None\]"):
        lm(IDS[0])
    with pytest.raises(ValueError, match="the input has 129 tokens, more than the model's context of 128 tokens"):
        lm(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="the input has 200 tokens, more than the model's context of 128"):
        lm.score(torch.zeros(200, dtype=torch.long))
    small = kw.from_hf(FAMILIES[family](vocab_size=96))
    small.tokenizer = char_level()  # ids 0-97: "~" is 96, past this model's 96 tokens
    with pytest.raises(ValueError, match=r"the tokenizer gave token id 96 for 'a~', but the model has 96 tokens"):
        small.generate("a~")
    with pytest.raises(ValueError, match="the tokenizer gave token id 96"):
        small.score("a~")


def test_caches_are_float32_only(tiny_lm):
    with pytest.raises(ValueError, match=r"init_cache\(dtype=torch.bfloat16\): the cached layers keep keys and values "
                                         r"in torch.float32"):
        tiny_lm.cached.init_cache(1, 16, dtype=torch.bfloat16)
    cache = tuple((k.bfloat16(), v.bfloat16()) for k, v in tiny_lm.cached.init_cache(1, 16))
    mask = torch.ones(1, 16, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"cache of '.*' must be torch.float32; got \[torch.bfloat16, torch.bfloat16\]"):
        tiny_lm.cached(IDS, torch.arange(5)[None], 0, mask, cache)
    assert tiny_lm.cached.init_cache(1, 16, dtype=CACHE_DTYPE)[0][0].dtype == torch.float32


def test_quantize_int4_refuses_before_changing_anything(family):
    lm = kw.from_hf(FAMILIES[family](vocab_size=100))  # 100 rows: the int4 kernel packs rows in 16s
    before = {n: type(m) for n, m in lm.named_modules()}
    with pytest.raises(ValueError, match=r"int4 needs a multiple of 16 output rows; the head has 100 \(shape \(100, 32\)\)"):
        kw.quantize(lm, "int4")
    assert {n: type(m) for n, m in lm.named_modules()} == before and lm.head.quantized is None
    kw.quantize(lm, "int4", head=False)  # the layers alone fit
    assert lm.head.quantized is None and torch.isfinite(lm(IDS)).all()


def test_from_hf_and_export_take_dtype_names(tmp_path):
    hf = FAMILIES["gpt2"]()
    assert next(kw.from_hf(hf, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    lm = kw.from_hf(hf)
    with pytest.raises(ValueError, match="ONNX export of bfloat16 weights: onnxruntime's CPU kernels cannot run them; "
                                         "pass dtype='float32'"):
        kw.export(lm, tmp_path / "m.onnx", dtype="bfloat16")
    with pytest.raises(ValueError, match="ONNX export of bfloat16 weights"):
        kw.export(kw.from_hf(hf, dtype="bfloat16"), tmp_path / "m.onnx")
    with pytest.raises(ValueError, match=r"unsupported dtype 'int8'; expected one of \['bfloat16', 'float16', 'float32'\]"):
        kw.export(lm, tmp_path / "m.onnx", dtype="int8")
    assert not (tmp_path / "m.onnx").exists()
