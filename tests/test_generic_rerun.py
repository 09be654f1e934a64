"""Models whose cache the pass cannot find, run by rerunning each decoder layer over the inputs it
keeps (`kvwire.models.generic.rerun`): a layer with no cache at all (GPT-1), a model computing its
positions from the one past length its cache reports (TrOCR); and only the layers that read one past length for
the batch (Llama 4's temperature-tuned NoPE layers), the others keeping their caches. Each
must equal transformers' uncached forward, alone, left-padded, and in the engine at per-row cache
indices."""
import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvwire as kw
from kvwire.models.generic import rerun

from .generic_configs import greedy_disagreements, hf_logits, prompt, rollout, rows_joining_a_batch, tiny_model

transformers = pytest.importorskip("transformers")

TYPES = {  # type -> what the cache pass says of it
    "openai-gpt": "takes no `cache` argument",
    "trocr": "cached decoding does not reproduce the model's own logits",
    "llama4_text": "one number for the batch",
}
PARTLY = {"llama4_text": [3]}  # type -> the layers that rerun where the others keep their caches
L = 32


@pytest.fixture(scope="module", params=sorted(TYPES))
def model(request):
    original = tiny_model(request.param)
    hf = copy.deepcopy(original)
    with pytest.warns(UserWarning, match="rerun over their kept inputs"):
        lm = kw.from_hf(original, generic=True)
    return SimpleNamespace(type=request.param, hf=hf, lm=lm)


def test_the_build_says_why_the_layers_rerun(model):
    backbone = model.lm.backbone
    assert TYPES[model.type] in backbone.rerun_reason
    assert backbone.rerun_layers == PARTLY.get(model.type, list(range(len(backbone.layers))))
    width = model.lm.head.weight.shape[1]
    for part in backbone.layers:
        kept = part.cache_spec(2, L, torch.float32) == ((2, 1, L, width), (2, 1, L, 1))  # (B, 1, L, D)
        assert kept == (part.index in backbone.rerun_layers), part.index
    assert model.lm.backbone.prelude.cache_spec(2, L, torch.float32) == ((2, 1, L, 1), (2, 1, L, 1))


def test_cached_greedy_equals_the_uncached_rollout(model):
    ids = prompt(2, 9, seed=2)
    tokens = torch.stack(model.lm.generate(ids, max_new_tokens=10, ignore_eos=True))
    expected = rollout(lambda x: hf_logits(model.hf, x), ids, tokens.shape[1])
    assert torch.equal(tokens, expected) or greedy_disagreements(lambda x: hf_logits(model.hf, x), ids, tokens) == []


def test_left_padded_rows_equal_each_alone(model):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 100, (n,), generator=g) for n in (4, 11, 7)]
    batch = model.lm.generate(rows, max_new_tokens=8, ignore_eos=True)
    for i, row in enumerate(rows):
        assert batch[i].tolist() == model.lm.generate(row, max_new_tokens=8, ignore_eos=True).tolist(), i


def test_rows_joining_a_batch_at_other_cache_indices_equal_each_alone(model):
    rows_joining_a_batch(model.lm, (6, 9, 4), (8, 5, 7), max_length=L, prefill_chunk=2, seed=5, head_start=4)


def test_a_control_vector_reruns_with_the_history(model):
    """A vector added after block 1 changes every past token's input to block 2: cached greedy of
    the steered model equals its own uncached rollout."""
    width = model.lm.head.weight.shape[1]
    v = torch.randn(width, generator=torch.Generator().manual_seed(0))
    steered = model.lm.steer(kw.ControlVector({1: v}), 4.0)
    ids = prompt(2, 9, seed=4)
    with torch.no_grad():
        assert not torch.allclose(steered(ids), model.lm(ids), atol=1e-3)
    tokens = torch.stack(steered.generate(ids, max_new_tokens=6, ignore_eos=True))
    assert greedy_disagreements(lambda x: steered(x), ids, tokens) == []


def test_a_model_the_cache_pass_fits_keeps_its_cache():
    lm = kw.from_hf(tiny_model("llama"), generic=True)
    assert lm.backbone.rerun_reason is None
    assert lm.backbone.prelude.cache_spec(1, L, torch.float32) is None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_packing_puts_each_rows_real_tokens_first_in_order(data):
    B = data.draw(st.integers(1, 3))
    M = data.draw(st.integers(2, 10))
    T = data.draw(st.integers(1, M))
    rows = data.draw(st.booleans())
    starts = [data.draw(st.integers(0, M - T)) for _ in range(B if rows else 1)]
    mask = torch.tensor([[data.draw(st.booleans()) for _ in range(M)] for _ in range(B)])
    cache_index = torch.tensor(starts) if rows else torch.tensor(starts[0])
    source, chunk, real = rerun.packing(cache_index, T, mask)
    counts = [sum(1 for c in range(M) if mask[b, c] and c < starts[b if rows else 0] + T) for b in range(B)]
    W = max(max(counts), 1)  # run eagerly, the window ends at the longest row's last real token
    assert source.shape == real.shape == (B, W)
    for b in range(B):
        start = starts[b if rows else 0]
        kept = [c for c in range(M) if mask[b, c] and c < start + T]
        n = len(kept)
        assert source[b, :n].tolist() == kept
        assert len(set(source[b].tolist())) == W  # no column read twice
        assert real[b].tolist() == [j < n for j in range(W)]
        for t in range(T):
            if mask[b, start + t]:
                assert source[b, chunk[b, t]] == start + t
            assert 0 <= chunk[b, t] < W


def test_a_rerunning_model_exports_to_onnx_and_runs_transformers_tokens(tmp_path):
    """The rerun's packing (cumulative sums, a scatter, gathers) is static-shape: GPT-1, cached by
    its layers' inputs, exports and generates transformers' tokens in ONNX Runtime."""
    pytest.importorskip("onnxruntime")
    from kvwire.export import load_exported

    original = tiny_model("openai-gpt", n_layer=2)  # two layers: an export's time grows with each
    hf = copy.deepcopy(original)
    with pytest.warns(UserWarning, match="rerun"):
        lm = kw.from_hf(original, generic=True)
    kw.export(lm, tmp_path / "m.onnx", max_length=32)
    ids = prompt(1, 9, 6)
    got = load_exported(tmp_path / "m.onnx").generate(ids, max_new_tokens=8, ignore_eos=True)[0].tolist()
    assert got[-8:] == rollout(lambda x: hf_logits(hf, x), ids, 8)[0].tolist()


def test_a_conversations_next_turn_reuses_the_kept_inputs(model):
    """The prefix store keeps a finished sequence's columns (layer inputs, token ids) as it keeps
    keys and values: the next turn reuses them and equals its prompt run alone."""
    from kvwire.generate import Engine, PrefixStore

    store = PrefixStore(min_tokens=4)
    engine = Engine(model.lm, max_batch=2, max_length=L, prefix_store=store)
    turn1 = prompt(1, 8, seed=6)[0].tolist()
    a = engine.submit(turn1, 5)
    for _ in engine.run([a]):
        pass
    turn2 = turn1 + a.tokens + [5, 6, 7]
    b = engine.submit(turn2, 5)
    for _ in engine.run([b]):
        pass
    assert store.hits == 1 and b.cached_tokens == len(turn1) + len(a.tokens) - 1
    alone = model.lm.generate(torch.tensor(turn2), max_new_tokens=5, ignore_eos=True, return_logprobs=True)
    assert b.tokens == alone.tokens[0]
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(alone.logprobs[0]), atol=1e-4, rtol=1e-4)


def test_a_gated_edit_inside_rerunning_blocks_keeps_each_tokens_gate(monkeypatch):
    """A vector added at attn_out of a rerunning block (its attention calls still name its sites),
    gated by a probe at block 1: each token's gate is kept beside its inputs, so the edit reruns over
    the history as it was gated, and cached greedy equals the steered model's own rollout."""
    lm = _made_to_rerun(monkeypatch, "llama")
    block = lm.backbone.layers[2]
    assert "attn_out" in block.inner_sites
    g = torch.Generator().manual_seed(7)
    w, v = torch.randn(block.width, generator=g), torch.randn(block.width, generator=g)
    ids = prompt(2, 9, seed=8)
    steered = lm.steer(kw.ControlVector({2: v}, site="attn_out"), 4.0, gate=kw.Gate(w, layer=1, threshold=0.0))
    with torch.no_grad():
        ungated = lm.steer(kw.ControlVector({2: v}, site="attn_out"), 4.0)
        assert not torch.allclose(steered(ids), ungated(ids), atol=1e-3)  # the gate shuts some tokens
    tokens = torch.stack(steered.generate(ids, max_new_tokens=8, ignore_eos=True))
    assert greedy_disagreements(lambda x: steered(x), ids, tokens) == []


def test_a_window_past_the_position_table_keeps_each_rows_positions(monkeypatch):
    """GPT-2's learned positions stop at n_positions. Made to rerun, it runs an engine whose
    max_length is longer: the pad columns of each window take the row's last position, not their
    column's, so no position past the row's is looked up, and rows equal each alone."""
    lm = _made_to_rerun(monkeypatch, "gpt2")
    original = lm.backbone.prelude.base
    rows_joining_a_batch(lm, (6, 9), (5, 4), max_length=original.config.n_positions + 20, prefill_chunk=4, seed=9)


def _made_to_rerun(monkeypatch, model_type):
    """The generic model of a tiny `model_type` whose cache checks are made to refuse it: it reruns."""
    from kvwire.models.generic import build

    def refuse(name, *args):
        raise ValueError(f"{name}: made to rerun")

    monkeypatch.setattr(build, "_check_all_cached", refuse)
    with pytest.warns(UserWarning, match="rerun"):
        return kw.from_hf(tiny_model(model_type), generic=True)


@pytest.mark.parametrize("make", [
    lambda d: kw.steer.Steer(d, 2.0), lambda d: kw.steer.Ablate(d[None]), lambda d: kw.steer.Clamp(d[None], -0.1, 0.1)])
def test_edits_act_on_each_residual_stream_as_on_a_token(make):
    """Hidden states of several residual streams (B, T, streams, D: DeepSeek V4's hyper-connections)
    are steered, ablated and clamped stream by stream, as each stream alone would be."""
    g = torch.Generator().manual_seed(11)
    d, x = torch.randn(8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    edit = make(d)
    want = torch.stack([edit(x[:, :, s]) for s in range(3)], dim=2)
    torch.testing.assert_close(edit(x), want)
    torch.testing.assert_close(edit(x[:, -1:]), want[:, -1:])  # a decode step


def test_only_what_a_next_layer_carries_is_kept(model):
    """A layer's returned tuple is kept for the call only where the next layer carries part of it
    (none of these models): nothing window-sized outlives the layer."""
    from kvwire.models.generic import parts

    model.lm.generate(prompt(1, 5, seed=1), max_new_tokens=2, ignore_eos=True)
    assert not any(part.hands_on for part in model.lm.backbone.layers)
    assert parts._outputs.get() in (None, {})
