"""Property tests of beam search (hypothesis) on random tiny models, edits and left-padded batches:
what beam search returns is scored by the uncached model, and where its result is known
(one beam; two tokens; a beam as wide as the vocabulary) it is that result. Profiles: conftest."""
import contextlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire as kw

from .property_checks import ATOL, check_greedy, check_logprobs, sequence_logprob
from .property_models import EOS, examples, model, numbered, shifted_blocks, specs, steered, token_rows


def _prompts(data, lm, max_rows=3):
    rows = data.draw(token_rows(lm.vocab_size, max_rows=max_rows), label="rows")
    return rows, [torch.tensor(r) for r in rows]


@settings(max_examples=examples(1.5))
@given(spec=specs(), data=st.data())
def test_one_beam_equals_greedy(spec, data):
    """BeamSearch(num_beams=1) returns greedy's tokens and log-probabilities, EOS rules included
    (two runs may part only after a float32 near-tie, where both are greedy rollouts). With a
    repetition penalty it is the rollout of the penalised log-probabilities (which greedy does not
    rank by: it penalises logits)."""
    lm = model(spec)
    rows, prompts = _prompts(data, lm)
    new, ignore_eos = data.draw(st.integers(1, 6), label="new"), data.draw(st.booleans(), label="ignore_eos")
    penalty = data.draw(st.none() | st.sampled_from([0.2, 0.5, 1.5, 3.0]), label="repetition_penalty")
    beam = lm.generate_ids(prompts, new, sampler=kw.BeamSearch(num_beams=1), ignore_eos=ignore_eos,
                           repetition_penalty=penalty)
    stops = () if ignore_eos else (EOS,)
    if penalty is not None:
        for row, tokens, logprobs in zip(rows, beam.tokens, beam.logprobs):
            check_greedy(lm, row, tokens, logprobs, new, stops, penalty, on_logprobs=True)
        return
    greedy = lm.generate_ids(prompts, new, ignore_eos=ignore_eos)
    for row, tokens, logprobs, greedy_tokens, greedy_logprobs in zip(rows, beam.tokens, beam.logprobs,
                                                                    greedy.tokens, greedy.logprobs):
        if tokens == greedy_tokens:
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(greedy_logprobs), atol=ATOL, rtol=0)
        else:
            check_greedy(lm, row, tokens, logprobs, new, stops)
            check_greedy(lm, row, greedy_tokens, greedy_logprobs, new, stops)


@settings(max_examples=examples(1.5))
@given(spec=specs(), data=st.data())
def test_beam_hypothesis_is_scored_by_the_uncached_model(spec, data):
    """For 2-4 beams, any length penalty and stopping rule, a repetition penalty or none, per-row
    steering strengths or none: the best hypothesis's log-probabilities are the uncached ones of
    that sequence (beams copy and reorder the rows' caches and inputs); it has no EOS, and all
    `new` tokens when EOS is ignored. With two new tokens (EOS ignored, no repetition penalty) its
    summed log-probability is at least greedy's: greedy's first token is among the beams, so
    greedy's sequence is among the candidates. (From three tokens on that need not hold:
    greedy's prefix can drop out of the beam.)"""
    lm = model(spec)
    rows, prompts = _prompts(data, lm)
    n, new = data.draw(st.integers(2, 4), label="num_beams"), data.draw(st.integers(1, 6), label="new")
    penalty = data.draw(st.sampled_from([0.0, 1.0, 2.0]), label="length_penalty")
    early = data.draw(st.sampled_from([False, True, "never"]), label="early_stopping")
    ignore_eos = data.draw(st.booleans(), label="ignore_eos")
    repetition = data.draw(st.none() | st.sampled_from([0.5, 2.0]), label="repetition_penalty")
    blocks, generator = sorted(numbered(spec)), lm
    strengths = data.draw(st.none() | st.lists(st.floats(-3.0, 3.0), min_size=len(rows), max_size=len(rows)),
                          label="steer strengths") if blocks else None
    options = dict(ignore_eos=ignore_eos, repetition_penalty=repetition)
    if strengths is not None:
        layers = tuple(data.draw(st.sets(st.sampled_from(blocks), min_size=1), label="layers"))
        generator, vector = steered(spec, tuple(sorted(layers)), 0)
        options["inputs"] = {"steer_strength": torch.tensor(strengths), "steer2_strength": torch.zeros(len(rows))}
    beam = kw.BeamSearch(num_beams=n, length_penalty=penalty, early_stopping=early)
    gen = generator.generate_ids(prompts, new, sampler=beam, **options)
    compare = ignore_eos and new <= 2 and repetition is None
    greedy = generator.generate_ids(prompts, new, **options).tokens if compare else None
    for i, (row, tokens, logprobs) in enumerate(zip(rows, gen.tokens, gen.logprobs)):
        steering = shifted_blocks(spec, vector, strengths[i]) if strengths is not None else contextlib.nullcontext(lm)
        with steering as reference:
            total = check_logprobs(reference, row, tokens, logprobs)
            assert len(tokens) == new if ignore_eos else len(tokens) <= new and EOS not in tokens, tokens
            if greedy is not None:
                assert total >= sequence_logprob(reference, row, greedy[i]) - 2 * ATOL, (tokens, greedy[i])


@settings(max_examples=examples(1.0))
@given(spec=specs(), data=st.data())
def test_beam_as_wide_as_the_vocabulary_is_exact(spec, data):
    """num_beams = vocabulary size, one or two new tokens, EOS ignored: beam search keeps every
    first token, so its best hypothesis is the best continuation of all V ** new, computed uncached."""
    lm = model(spec)
    V = lm.vocab_size
    rows, prompts = _prompts(data, lm, max_rows=2)
    new = data.draw(st.integers(1, 2), label="new")
    penalty = data.draw(st.sampled_from([0.0, 1.0]), label="length_penalty")
    gen = lm.generate_ids(prompts, new, sampler=kw.BeamSearch(num_beams=V, length_penalty=penalty), ignore_eos=True)
    for row, tokens, logprobs in zip(rows, gen.tokens, gen.logprobs):
        total = check_logprobs(lm, row, tokens, logprobs)
        with torch.no_grad():
            best = torch.log_softmax(lm(torch.tensor([row]))[0, -1], -1)  # (V,): by first token
            if new == 2:  # every first token t, then the best second token after it
                ids = torch.cat([torch.tensor([row]).expand(V, -1), torch.arange(V)[:, None]], dim=1)
                best = best + torch.log_softmax(lm(ids)[:, -1], -1).max(-1).values
        assert abs(total - float(best.max())) <= 2 * ATOL, (tokens, total, float(best.max()))
