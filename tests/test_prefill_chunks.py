"""Long prompts are prefilled in bounded calls (`session.PREFILL_CALL_TOKENS` prompt tokens a call,
all rows together), with the same tokens and log-probabilities as one call. The budget is set
small here so tiny prompts cross it; ring caches (gemma3's window of 4, mistral) see chunks
shorter and longer than the window."""
import pytest
import torch

import kvwire as kw
from kvwire.generate import prefill as engine_module  # the engine runs its prefill calls there
from kvwire.generate import session as session_module
from kvwire.generate.session import prefill_step

from .conftest import FAMILIES

KINDS = ["gemma3", "mistral", "gpt2", "llama"]
ONE_CALL = 10_000  # a budget no test prompt reaches


def tiny(family):
    return kw.from_hf(FAMILIES[family](seed=0))


def rows_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def recorded_calls(monkeypatch, module):
    """The (rows, tokens) of every prefill call `module` makes from now on."""
    calls, original = [], module.prefill_chunk

    def recording(cached, head, decode, ids, *args, **kwargs):
        calls.append(tuple(ids.shape))
        return original(cached, head, decode, ids, *args, **kwargs)
    monkeypatch.setattr(module, "prefill_chunk", recording)
    return calls


def generated(lm, rows, **options):
    gen = lm.generate([torch.tensor(r) for r in rows] if len(rows) > 1 else torch.tensor(rows[0]),
                      max_new_tokens=6, ignore_eos=True, return_logprobs=True, **options)
    return gen.tokens, torch.tensor(gen.logprobs)


@pytest.mark.parametrize("family", KINDS)
def test_a_batch_of_long_prompts_prefills_in_bounded_calls_like_one_call(family, monkeypatch):
    lm = tiny(family)
    rows = rows_of([5, 19, 30])  # left-padded to 30 tokens a row
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", ONE_CALL)
    calls = recorded_calls(monkeypatch, engine_module)
    tokens, logprobs = generated(lm, rows)
    assert calls == [(3, 30)]
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", 8)  # 2 tokens a row a call
    calls.clear()
    chunked_tokens, chunked_logprobs = generated(lm, rows)
    assert calls == [(3, 2)] * 15
    assert chunked_tokens == tokens
    torch.testing.assert_close(chunked_logprobs, logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_one_long_prompt_runs_in_whole_budgets_then_the_rest(family, monkeypatch):
    lm = tiny(family)
    rows = rows_of([23])
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", ONE_CALL)
    tokens, logprobs = generated(lm, rows)
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", 8)
    calls = recorded_calls(monkeypatch, engine_module)
    chunked_tokens, chunked_logprobs = generated(lm, rows)
    assert calls == [(1, 8), (1, 8), (1, 7)]
    assert chunked_tokens == tokens
    torch.testing.assert_close(chunked_logprobs, logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_beam_search_prefills_in_bounded_calls_like_one_call(family, monkeypatch):
    lm = tiny(family)
    prompt = torch.tensor(rows_of([21])[0])
    beam = kw.BeamSearch(num_beams=3)
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", ONE_CALL)
    whole = lm.generate(prompt, max_new_tokens=5, sampler=beam, ignore_eos=True)
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", 4)
    calls = recorded_calls(monkeypatch, session_module)
    assert torch.equal(lm.generate(prompt, max_new_tokens=5, sampler=beam, ignore_eos=True), whole)
    assert calls == [(1, 4)] * 5 + [(1, 1)]  # 21 = 5 x 4 + 1 (decode steps take another path)


def test_prefill_step_shares_the_budget_out_in_whole_program_chunks():
    budget = session_module.PREFILL_CALL_TOKENS
    assert prefill_step(1) == budget
    assert prefill_step(3) == budget // 3
    assert prefill_step(budget * 2) == 1  # more rows than the budget: a token a row
    assert prefill_step(1, multiple=48) == budget // 48 * 48
    assert prefill_step(4, multiple=48) == budget // 4 // 48 * 48
    assert prefill_step(budget, multiple=8) == 8  # never less than one program chunk


def test_prompts_joining_a_busy_engine_prefill_in_bounded_calls_too(monkeypatch):
    """Rows that arrive while another decodes go through a scratch cache: their calls keep to the
    budget as well (and to `prefill_chunk`), with the tokens of single runs."""
    lm = tiny("gemma3")
    first, *later = rows_of([6, 20, 17], seed=1)
    alone = [generated(lm, [r])[0][0] for r in (first, *later)]
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", 8)
    engine = kw.Engine(lm, max_batch=3, max_length=40)
    a = engine.submit(first, 6)
    for _ in range(2):
        engine.step()  # `a` is decoding now
    calls = recorded_calls(monkeypatch, engine_module)
    joined = [engine.submit(r, 6) for r in later]
    for _ in engine.run([a, *joined]):
        pass
    assert engine.stats["scratch_prefills"] >= 1
    assert calls and max(rows * tokens for rows, tokens in calls) <= 8
    assert [s.tokens for s in (a, *joined)] == alone


def test_an_empty_batch_of_prompts_is_refused_clearly():
    lm = tiny("llama")
    with pytest.raises(ValueError, match="every prompt of the batch is empty"):
        session_module.Session(lm.cached, lm.head, [[]], 8).prefill()


def test_a_models_own_budget_bounds_its_calls_and_edits_keep_it(monkeypatch):
    """`lm.prefill_call_tokens` (ggml quantisation sets 256) instead of the module's budget, in the
    engine (sampling) and in sessions (beam search), and on an edited copy of the model."""
    lm = tiny("gemma3")
    rows = rows_of([23])
    monkeypatch.setattr(session_module, "PREFILL_CALL_TOKENS", ONE_CALL)
    tokens, logprobs = generated(lm, rows)
    lm.prefill_call_tokens = 8
    calls = recorded_calls(monkeypatch, engine_module)
    chunked_tokens, chunked_logprobs = generated(lm, rows)
    assert calls == [(1, 8), (1, 8), (1, 7)]
    assert chunked_tokens == tokens
    torch.testing.assert_close(chunked_logprobs, logprobs, atol=1e-5, rtol=1e-5)
    edited = lm.edit(kw.skip("layers.1"))
    assert edited.prefill_call_tokens == 8
    beam_calls = recorded_calls(monkeypatch, session_module)
    edited.generate(torch.tensor(rows[0]), max_new_tokens=3, sampler=kw.BeamSearch(num_beams=2), ignore_eos=True)
    assert beam_calls == [(1, 8), (1, 8), (1, 7)]
