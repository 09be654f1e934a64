"""CAST's prompt-level condition (`Gate(scope="prompt")`): one decision from the mean of a row's
prompt states, a state slot in the cache. Reference: the same rule written with transformers hooks
(running mean over the prompt, the prompt's mean for generated tokens); the engine's chunked
prefill, joining rows, growth and prefix store keep it; export."""
import pytest
import torch

import kvwire as kw
from kvwire.generate import Engine, PrefixStore

from .conftest import FAMILIES
from .test_engine import drive, prompts, single

PROMPT = torch.tensor([[3, 17, 42, 9, 55, 23, 7, 61, 30]])


def _layers(hf):
    return hf.model.layers


def _prompt_scores(hf, ids, c, layer):
    """The running-mean cosine score at block `layer`'s output for each prompt position: (T,)."""
    seen = {}
    h = _layers(hf)[layer].register_forward_hook(lambda m, a, o: seen.setdefault("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hf(ids)
    h.remove()
    x = seen["h"][0]
    mean = torch.cumsum(x, 0) / torch.arange(1, x.shape[0] + 1)[:, None]
    return (mean @ c) / (mean.norm(dim=-1) * c.norm())


def _setting(hf, D):
    """A condition vector and a threshold under which the decision flips inside the prompt and ends
    open: the prompt-level latch then differs from a per-position gate and from no gate."""
    for seed in range(20):
        c = torch.randn(D, generator=torch.Generator().manual_seed(seed))
        s = _prompt_scores(hf, PROMPT, c, 1)
        if s[:-1].min() < s[-1] - 0.05:
            return c, float(s[-1] - 0.02)
    raise AssertionError("no condition vector found whose running score rises within the prompt")


def hf_latched(hf, ids, steps, c, threshold, v, probe_layer, steered):
    """transformers' uncached rollout with CAST written as hooks: the gate at position t reads the
    mean of block `probe_layer`'s outputs over prompt positions <= min(t, L - 1)."""
    L, x = ids.shape[1], ids
    for _ in range(steps):
        seen = {}

        def probe(m, a, o):
            h = o[0] if isinstance(o, tuple) else o
            w = (torch.arange(h.shape[1]) < L).float()[None, :, None]
            mean = torch.cumsum(h * w, 1) / torch.cumsum(w, 1).clamp_min(1)
            seen["g"] = (((mean @ c) / (mean.norm(dim=-1) * c.norm())) > threshold).float()[..., None]

        def steer(m, a, o):
            return (o[0] + seen["g"] * v, *o[1:]) if isinstance(o, tuple) else o + seen["g"] * v

        hooks = [_layers(hf)[probe_layer].register_forward_hook(probe)]
        hooks += [_layers(hf)[i].register_forward_hook(steer) for i in steered]
        with torch.no_grad():
            logits = hf(x).logits
        for h in hooks:
            h.remove()
        x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[:, L:]


@pytest.fixture(scope="module")
def latched():
    hf = FAMILIES["llama"]().eval()
    lm = kw.from_hf(hf)
    D = lm.head.weight.shape[1]
    c, threshold = _setting(hf, D)
    v = 4 * torch.randn(D, generator=torch.Generator().manual_seed(99))
    gate = kw.Gate(c, layer=1, threshold=threshold, kind="cosine", scope="prompt")
    return hf, lm, lm.steer(kw.ControlVector({2: v, 3: v}), 1.0, gate=gate), (c, threshold, v)


def test_a_prompt_gate_equals_cast_written_with_hooks(latched):
    hf, lm, model, (c, threshold, v) = latched
    assert "layers_1_block_out__PromptProbe" in model.cached.names  # a state slot in the cache
    got = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].tolist()
    assert got == hf_latched(hf, PROMPT, 8, c, threshold, v, 1, (2, 3))[0].tolist()
    per_position = lm.steer(kw.ControlVector({2: v, 3: v}), 1.0,
                            gate=kw.Gate(c, layer=1, threshold=threshold, kind="cosine"))
    assert got != lm.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].tolist()  # the gate opens
    assert not torch.allclose(model(PROMPT), per_position(PROMPT), atol=1e-3)  # not each position's own


def test_a_closed_prompt_stays_closed_for_every_generated_token(latched):
    hf, lm, model, (c, threshold, v) = latched
    shut = {"gate_threshold": torch.tensor([2.0])}  # a cosine never passes 2: never steered
    assert model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, inputs=shut)[0].tolist() == \
        lm.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].tolist()


def test_engine_rows_chunks_growth_and_prefix_store_keep_each_rows_state(latched, monkeypatch):
    """Rows of other lengths joining a running batch, prompts prefilled in chunks of 3 (the state
    carried across chunks), a growing timeline and a prefix store: each row == its single run."""
    from kvwire.generate import engine as engine_module

    _, _, model, _ = latched
    monkeypatch.setattr(engine_module, "GROW_FROM", 8)
    rows = [PROMPT[0].tolist()] + prompts(4, seed=3, low=4, high=12)
    budgets = [8, 3, 10, 5, 6]
    store = PrefixStore(min_tokens=2)
    engine = Engine(model, max_batch=2, max_length=48, prefill_chunk=3, grow=True, prefix_store=store)
    first = engine.submit(rows[0], budgets[0])
    drive(engine, [first], steps=2)
    rest = [engine.submit(r, n) for r, n in zip(rows[1:], budgets[1:])]
    again = engine.submit(rows[0] + first.tokens[:0], budgets[0])  # the same prompt: a stored prefix
    seqs = [first, *rest, again]
    drive(engine, seqs)
    assert engine.stats["scratch_prefills"] >= 2
    for seq, row, n in zip(seqs, rows + [rows[0]], budgets + [budgets[0]]):
        tokens, logprobs = single(model, row, n)
        assert seq.tokens == tokens, row
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


def test_rows_with_their_own_thresholds_equal_each_alone(latched):
    _, _, model, (_, threshold, _) = latched
    rows = {"gate_threshold": torch.tensor([threshold, 2.0, -2.0])}
    batch = model.generate([PROMPT[0], PROMPT[0, :5], PROMPT[0]], max_new_tokens=6, ignore_eos=True, inputs=rows)
    for r, prompt in enumerate([PROMPT[0], PROMPT[0, :5], PROMPT[0]]):
        alone = model.generate(prompt[None], max_new_tokens=6, ignore_eos=True,
                               inputs={"gate_threshold": rows["gate_threshold"][r:r + 1]})
        assert batch[r].tolist() == alone[0].tolist(), r


def test_an_exported_graph_carries_the_state_slot(tmp_path, latched):
    pytest.importorskip("onnxruntime")
    from .tokenizers_for_tests import char_level

    hf, lm, _, (c, threshold, v) = latched
    lm = kw.from_hf(FAMILIES["llama"](vocab_size=100))
    lm.tokenizer = char_level()
    D = lm.head.weight.shape[1]
    model = lm.steer(kw.ControlVector({2: v[:D], 3: v[:D]}), 1.0,
                     gate=kw.Gate(c[:D], layer=1, threshold=0.0, kind="cosine", scope="prompt"))
    path = tmp_path / "cast.onnx"
    kw.export(model, path, max_length=48)
    onnx_lm = kw.load_exported(path)
    texts = ["Hello there", "A longer prompt here"]
    for thresholds in (None, {"gate_threshold": torch.tensor([-0.05, 0.05])}):
        assert onnx_lm.generate(texts, max_new_tokens=6, inputs=thresholds) == \
            model.generate(texts, max_new_tokens=6, inputs=thresholds)


def test_bad_gate_scope_is_refused_by_name(latched):
    _, lm, _, (c, _, v) = latched
    with pytest.raises(ValueError, match=r"gate scope must be one of \('position', 'prompt'\), got 'chunk'"):
        lm.steer(kw.ControlVector({2: v}), 1.0, gate=kw.Gate(c, layer=1, scope="chunk"))


def test_compiled_steps_carry_the_state_too(latched):
    _, _, model, _ = latched
    want = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].tolist()
    compiled = model.compile(backend="eager", bucket=8)
    assert compiled.generate(PROMPT, max_new_tokens=8, ignore_eos=True)[0].tolist() == want
