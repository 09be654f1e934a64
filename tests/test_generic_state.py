"""State slots of the generic path: transformers' recurrent, convolution and linear-attention
layers cached through kvwire's cache contract (`kvwire.models.generic.state`).

Three kinds of state, each on its own tiny random model: LFM2's short convolutions (a conv state
only), Qwen3-Next's gated delta-nets (a conv state and a recurrent state) and Mamba-2's scans; two
hybrids whose layers keep attention keys/values and state both (Falcon-H1's attention beside its
Mamba mixer in every layer, Zamba2's hybrid layers between Mamba layers); and Mamba-1 (Mamba,
FalconMamba), whose multi-token scan ignores a previous state, so chunks continuing one go token
by token (`kvwire.models.generic.stepping`); RecurrentGemma, whose state is in its modules'
attributes (`kvwire.models.generic.held`); and MiniMax, whose lightning attention keeps its state
in the model's own cache class (`kvwire.models.generic.owned`); RWKV and xLSTM, whose layers are
handed their state as an argument by the model's forward (`kvwire.models.generic.handed`). The
arbiter is transformers: its own cached `generate` and its uncached forward on the same weights."""
import copy
from types import SimpleNamespace

import pytest
import torch

import kvwire as kw
from kvwire.generate import Engine, PrefixStore

from .generic_configs import (PROMPT_IDS, cast_tokens_agree, hf_logits, prompt, rollout, rows_joining_a_batch,
                              tiny_config, tiny_model)

transformers = pytest.importorskip("transformers")

TYPES = ["lfm2", "qwen3_next", "mamba2", "falcon_h1", "zamba2", "mamba", "falcon_mamba", "recurrent_gemma", "minimax",
         "rwkv", "xlstm"]
# where transformers' scan of several tokens starts from zero whatever state it is handed, or the
# state is kept in module attributes (RecurrentGemma: `kvwire.models.generic.held`)
ONE_TOKEN_AT_A_TIME = {"mamba", "falcon_mamba", "recurrent_gemma"}
L = 48  # cache timeline of the direct calls
ATOL = 1e-4


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    original = tiny_model(request.param)
    hf = copy.deepcopy(original)  # kw.from_hf sets the original's attention implementation to kvwire's
    lm = kw.from_hf(original, generic=True)
    stateful = [i for i, part in enumerate(lm.backbone.layers) if part.states is not None]
    return SimpleNamespace(hf=hf, lm=lm, stateful=stateful, name=request.param)


def _ids(n, seed):
    return prompt(1, n, seed)[0]


def _run(lm, chunks, cache=None, start=0, first_position=0, rows=1):
    """Run token chunks (each (rows, t)) through the cached graph from timeline index `start`: the
    last hidden state (rows, D) and the cache."""
    cached = lm.cached
    cache = cached.init_cache(rows, L) if cache is None else cache
    mask = torch.ones(rows, L, dtype=torch.bool)
    at = start
    with torch.no_grad():
        for chunk in chunks:
            t = chunk.shape[1]
            positions = (torch.arange(at, at + t) - start + first_position)[None].expand(rows, t)
            hidden, cache = cached(chunk, positions, at, mask, cache)
            at += t
    return hidden[:, -1], cache


def _state_slot(cached, i):
    """Where layer i's state slot is in the cache: its own, or its "state" part in a layer that also
    keeps keys and values."""
    names = cached.names
    return names.index(f"layers.{i}.state") if f"layers.{i}.state" in names else names.index(f"layers.{i}")


def _states(m, cache):
    slots = [cache[_state_slot(m.lm.cached, i)] for i in m.stateful]
    return [t.clone() for pair in slots for t in pair]


def _close(a, b):
    """Equal to float32 rounding: within 1e-4 of each tensor's largest magnitude (a hybrid's stack
    of attention and scans rounds more than one mixer; a missed reset or a pad let in is O(1))."""
    return all(torch.allclose(x, y, atol=ATOL * max(1.0, x.abs().max().item()), rtol=1e-4) for x, y in zip(a, b))


def test_state_layers_hold_a_fixed_size_slot(model):
    assert model.stateful, "the model has layers with state"
    cached = model.lm.cached
    short, long = cached.init_cache(2, 16), cached.init_cache(2, 64)
    for i in model.stateful:
        k = _state_slot(cached, i)
        assert [t.shape for t in short[k]] == [t.shape for t in long[k]]  # does not grow with the timeline
        assert all(t.shape[:3] == (2, 1, 1) for t in short[k])  # a ring of one slot


def test_only_mixers_ignoring_a_previous_state_in_their_chunks_go_token_by_token(model):
    steps = {model.lm.backbone.layers[i].states.steps for i in model.stateful}
    assert steps == {model.name in ONE_TOKEN_AT_A_TIME}


def test_a_prompt_prefilled_in_chunks_leaves_the_state_of_one_call(model):
    ids = _ids(13, seed=1)[None]
    whole, cache = _run(model.lm, [ids])
    chunked, cache2 = _run(model.lm, [ids[:, :5], ids[:, 5:6], ids[:, 6:]])
    assert _close(_states(model, cache), _states(model, cache2))
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=1e-4)
    assert any(t.abs().max() > 0 for t in _states(model, cache))  # the state was written


def test_a_row_starting_at_position_0_starts_from_zero(model):
    first, second = _ids(9, seed=2)[None], _ids(6, seed=3)[None]
    _, used = _run(model.lm, [first])
    again, used = _run(model.lm, [second], cache=used)  # the row given to a new request
    fresh, clean = _run(model.lm, [second])
    torch.testing.assert_close(again, fresh, atol=ATOL, rtol=1e-4)
    assert _close(_states(model, used), _states(model, clean))
    # the same chunk continuing the row (not at position 0) keeps its state: the reset made the difference
    _, kept = _run(model.lm, [first])
    _, kept = _run(model.lm, [second], cache=kept, first_position=9)
    assert not _close(_states(model, kept), _states(model, clean))


def test_left_pads_do_not_enter_the_state(model):
    g = torch.Generator().manual_seed(4)
    long, short = _ids(9, seed=5), _ids(5, seed=6)
    junk = torch.randint(*PROMPT_IDS, (4,), generator=g)  # pad ids the model would see if they leaked
    ids = torch.stack([long, torch.cat([junk, short])])
    positions = torch.stack([torch.arange(9), (torch.arange(9) - 4).clamp(min=0)])
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[1, :4] = False
    cached = model.lm.cached
    with torch.no_grad():
        hidden, cache = cached(ids, positions, 0, mask, cached.init_cache(2, L))
    alone, alone_cache = _run(model.lm, [short[None]])
    torch.testing.assert_close(hidden[1, -1:], alone, atol=ATOL, rtol=1e-4)
    padded = [t[1:] for t in _states(model, cache)]
    assert _close(padded, _states(model, alone_cache))


def test_greedy_rows_of_different_lengths_equal_transformers_generate(model):
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(*PROMPT_IDS, (n,), generator=g) for n in (4, 11, 7)]
    batch = model.lm.generate(rows, max_new_tokens=10, ignore_eos=True)
    for i, row in enumerate(rows):
        with torch.no_grad():
            theirs = model.hf.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                       max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert batch[i].tolist() == theirs[0, len(row):].tolist(), i


def test_a_prompt_prefilled_four_tokens_a_call_gives_transformers_tokens(model):
    row = _ids(14, seed=15)
    model.lm.prefill_call_tokens = 4
    try:
        ours = model.lm.generate(row, max_new_tokens=8, ignore_eos=True)
    finally:
        model.lm.prefill_call_tokens = None
    with torch.no_grad():
        # eos_token_id=None: neither stops at nor suppresses the end token (kvwire's ignore_eos)
        theirs = model.hf.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                   max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert ours.tolist() == theirs[0, len(row):].tolist()


def test_left_padded_rows_prefilled_in_small_calls_equal_each_alone(model):
    """Two prompt tokens a row per prefill call: the short row's first calls hold only its pads, and
    its state starts in the call holding its first real token."""
    g = torch.Generator().manual_seed(13)
    rows = [torch.randint(*PROMPT_IDS, (n,), generator=g) for n in (11, 3, 7)]
    model.lm.prefill_call_tokens = 6
    try:
        batch = model.lm.generate(rows, max_new_tokens=8, ignore_eos=True, return_logprobs=True)
    finally:
        model.lm.prefill_call_tokens = None
    for i, row in enumerate(rows):
        alone = model.lm.generate(row, max_new_tokens=8, ignore_eos=True, return_logprobs=True)
        assert batch.tokens[i] == alone.tokens[0], i
        torch.testing.assert_close(torch.tensor(batch.logprobs[i]), torch.tensor(alone.logprobs[0]),
                                   atol=1e-4, rtol=1e-4)


def _single(lm, row, n):
    out = lm.generate(torch.tensor(row), max_new_tokens=n, ignore_eos=True, return_logprobs=True)
    return out.tokens[0], out.logprobs[0]


def _drive(engine, seqs):
    for _ in engine.run(seqs):
        pass


def test_rows_joining_in_chunks_and_reused_rows_equal_single_runs(model):
    """Rows join a decoding batch (prefilled 3 tokens a step into a scratch cache) and take rows
    that others left: each equals its own run."""
    engine = rows_joining_a_batch(model.lm, (5, 11, 8, 3), (9, 4, 7, 6), max_length=L, prefill_chunk=3, seed=8)
    assert engine.stats["scratch_prefills"] >= 2


def test_a_row_given_to_the_next_request_starts_afresh(model):
    engine = Engine(model.lm, max_batch=1, max_length=L)
    a = engine.submit(_ids(10, seed=9).tolist(), 6)
    _drive(engine, [a])
    row = _ids(4, seed=10).tolist()
    b = engine.submit(row, 6)
    _drive(engine, [b])
    assert engine.stats["direct_prefills"] == 2  # both prefilled into the same engine row
    assert b.tokens == _single(model.lm, row, 6)[0]


def test_a_stored_state_is_reused_only_at_its_stored_length(model):
    store = PrefixStore(min_tokens=4)
    engine = Engine(model.lm, max_batch=2, max_length=64, prefix_store=store)
    turn1 = _ids(10, seed=11).tolist()
    a = engine.submit(turn1, 6)
    _drive(engine, [a])
    turn2 = turn1 + a.tokens + [5, 6, 7]
    b = engine.submit(turn2, 6)
    _drive(engine, [b])
    assert b.cached_tokens == len(turn1) + len(a.tokens) - 1  # the last token was never fed
    assert b.tokens == _single(model.lm, turn2, 6)[0]
    # a prompt sharing only part of a stored sequence cannot take its state (kept for its end only)
    c = engine.submit(turn1[:7] + [9, 9, 9], 6)
    _drive(engine, [c])
    assert c.cached_tokens == 0
    assert c.tokens == _single(model.lm, turn1[:7] + [9, 9, 9], 6)[0]


# Two layers where a step is built or exported (each layer's kernels cost the build seconds), one of each kind
TWO_LAYERS = {"lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1]),
              "minimax": dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]),
              "rwkv": dict(num_hidden_layers=2)}


def test_a_short_convolution_model_exports_to_onnx_and_runs_the_same_tokens(tmp_path):
    """The state slot is a graph input and output like any cache (LFM2's short convolutions; the
    chunked scans of gated delta-nets and Mamba-2 loop over a chunk count in Python, which a
    dynamic-chunk ONNX program cannot take)."""
    pytest.importorskip("onnxruntime")
    from kvwire.export import load_exported

    original = tiny_model("lfm2", **TWO_LAYERS["lfm2"])  # a convolution and an attention layer
    hf = copy.deepcopy(original)
    lm = kw.from_hf(original, generic=True)
    kw.export(lm, tmp_path / "m.onnx", max_length=L)
    g = torch.Generator().manual_seed(12)
    rows = [torch.randint(*PROMPT_IDS, (n,), generator=g) for n in (9, 4)]
    runtime = load_exported(tmp_path / "m.onnx")
    for row in rows:
        with torch.no_grad():
            theirs = hf.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                 max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        got = runtime.generate(row[None], max_new_tokens=10, ignore_eos=True)[0]
        assert got.tolist() == theirs[0, len(row):].tolist()


@pytest.mark.parametrize("model_type, prefill_tokens", [("lfm2", 32), ("minimax", 0), ("rwkv", 0)])
def test_compiled_decode_steps_carry_the_state(model_type, prefill_tokens, tmp_path, monkeypatch):
    """`lm.compile()`: the decode steps (and, for LFM2, short last prompt chunks) run through
    Inductor, the state slot among their inputs and outputs (LFM2's, in transformers' Cache made in
    the step, its token count made from the states: one made in the Cache's constructor was a
    constant that kept the step eager; MiniMax's, in a cache object of the model's own class made in
    the step; RWKV's, in the argument made in the step, its one-token calls row by row); rows of
    different lengths keep eager tokens. MiniMax's and RWKV's prompts run eager here: a chunk's
    build costs a decode step's twice over (MiniMax's 35 s more), and RWKV's chunks step token by
    token, which an export of a dynamic chunk length refuses anyway."""
    from kvwire.generate.ahead import EAGER

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))  # built here, not loaded from an earlier run
    lm = kw.from_hf(tiny_model(model_type, **TWO_LAYERS[model_type]), generic=True)
    rows = [torch.tensor([3, 17, 42, 9, 55]), torch.tensor([7, 8])]
    eager = [t.tolist() for t in lm.generate(rows, max_new_tokens=12, ignore_eos=True)]
    torch._dynamo.reset()
    lm.compile(bucket=32, prefill_tokens=prefill_tokens)
    assert [t.tolist() for t in lm.generate(rows, max_new_tokens=12, ignore_eos=True)] == eager
    assert any(runner is not EAGER for runner in lm._decoder().runners.values())  # a step did compile


@pytest.mark.parametrize("model_type, follows", [("lfm2", {"conv": True}),
                                                  ("mamba", {"conv": True, "recurrent": False})])
def test_a_model_cast_to_bfloat16_after_the_build_hands_its_states_in_its_dtype(model_type, follows):
    """Which states follow the model's dtype (LFM2's and Mamba's convolutions) and which stay float32
    (Mamba's scan state) is told by probing in bfloat16: cast after the build, the model gives
    transformers' own bfloat16 tokens (states kept in the probe's float32 broke the bfloat16
    convolution; Mamba's residual, float32 between its layers, reaches its head cast)."""
    original = tiny_model(model_type)
    hf = copy.deepcopy(original)
    lm = kw.from_hf(original, generic=True)
    stateful = [part for part in lm.backbone.layers if part.states is not None]
    assert stateful and all({s.kind: s.follows for s in part.states.states} == follows for part in stateful)
    assert cast_tokens_agree(lm, hf, torch.bfloat16, (9, 5))


def test_a_minimax_model_cast_to_bfloat16_hands_its_linear_state_in_its_dtype():
    """MiniMax's linear-attention state, kept in the model's own cache class, follows the weights'
    dtype: cast to bfloat16 after the build, cached decoding continues it (a float32 state fails
    the bfloat16 product of its one-token step). Tokens are not compared with transformers here:
    this tiny random model is chaotic in bfloat16 (transformers' own bfloat16 and float32 forwards
    differ by more than the hidden states' size by the fourth layer), so one rounding apart in the
    first attention layer gives other tokens."""
    lm = kw.from_hf(tiny_model("minimax"), generic=True)
    stateful = [part for part in lm.backbone.layers if part.states is not None]
    assert stateful and all({s.kind: s.follows for s in part.states.states} == {"recurrent": True}
                            for part in stateful)
    lm = lm.to(torch.bfloat16)
    rows = [torch.tensor([5, 9, 33, 12, 40, 7]), torch.tensor([8, 21])]
    out = lm.generate(rows, max_new_tokens=6, ignore_eos=True)
    assert [len(t) for t in out] == [6, 6]


@pytest.mark.parametrize("model_type, follows", [("rwkv", [True, True, False, False, False]),
                                                  ("xlstm", [True, True, True])])
def test_a_model_handing_its_states_cast_to_bfloat16_hands_them_as_its_forward_does(model_type, follows):
    """The states a forward hands its layers follow the model's dtype where the forward makes them
    in its embeddings' dtype (RWKV's token-shift states and xLSTM's cache; RWKV's scan states stay
    float32): cast after the build, the model gives transformers' own bfloat16 tokens."""
    original = tiny_model(model_type)
    hf = copy.deepcopy(original)
    lm = kw.from_hf(original, generic=True)
    stateful = [part for part in lm.backbone.layers if part.states is not None]
    assert len(stateful) == len(lm.backbone.layers)
    assert all([h.follows for h in part.states.states] == follows for part in stateful)
    assert cast_tokens_agree(lm, hf, torch.bfloat16, (9, 5))


@pytest.mark.parametrize("every", [1, 3])
def test_a_scale_the_forward_puts_between_layers_is_kept(every):
    """RWKV's forward halves its hidden states after every `rescale_every` layers (in eval mode, its
    weights rescaled to match): the build finds the factor between two layers' inputs on its probe
    and scales the next layer's input by it, so cached rows of different lengths give transformers'
    uncached rollout (without it, the build refused the model: its logits were off by O(1))."""
    import transformers as tf

    config = tiny_config("rwkv")
    config.rescale_every = every
    torch.manual_seed(0)
    original = tf.AutoModelForCausalLM.from_config(config).eval()
    hf = copy.deepcopy(original)
    lm = kw.from_hf(original, generic=True)
    assert [part.scale_in for part in lm.backbone.layers] == [None if (i % every or not i) else 0.5 for i in range(4)]
    assert all(part.states is not None for part in lm.backbone.layers)
    rows = [torch.tensor([5, 9, 33, 12, 40, 7]), torch.tensor([8, 21, 3])]
    for row, got in zip(rows, lm.generate(rows, max_new_tokens=8, ignore_eos=True)):
        assert got.tolist() == rollout(lambda ids: hf_logits(hf, ids), row[None], 8)[0].tolist()
