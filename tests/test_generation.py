"""Generation surface on tiny models: batches, samplers, beam search, stopping, streaming, scoring."""
import itertools
import math

import pytest
import torch

import kvwire as kw

from .conftest import FAMILIES, tiny_hf_gpt2
from .tokenizers_for_tests import byte_level, char_level


@pytest.fixture
def chat(family):
    """A tiny model of each family with a character-level tokenizer (no EOS in its config)."""
    lm = kw.from_hf(FAMILIES[family](vocab_size=100))
    lm.tokenizer = char_level()
    return lm


@pytest.fixture
def bytes_lm():
    lm = kw.from_hf(tiny_hf_gpt2(vocab_size=300))
    lm.tokenizer = byte_level(300)
    return lm


PROMPTS = ["Hello there", "A", "Some longer prompt, with punctuation!"]


def test_greedy_batch_rows_equal_single_runs(chat):
    batch = chat.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert batch == [chat.generate(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS]
    assert len(set(batch)) > 1


def test_ragged_token_id_rows_equal_single_runs(chat):
    rows = [torch.tensor(chat.tokenizer.encode(p)) for p in PROMPTS]
    batch = chat.generate(rows, max_new_tokens=6, ignore_eos=True)
    assert [t.tolist() for t in batch] == [chat.generate(r, max_new_tokens=6, ignore_eos=True).tolist() for r in rows]
    assert chat.tokenizer.decode(batch[2].tolist()) == chat.generate(PROMPTS[2], max_new_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 100\); got values in \[0, 500\]"):
        chat.generate([rows[0], torch.tensor([0, 500])])


def test_rows_stop_independently(chat):
    free = chat.generate_ids(PROMPTS, max_new_tokens=12, ignore_eos=True)
    stop_id = free.tokens[0][3]  # by token: a special token decodes to several characters (<eos>)
    stopped = chat.generate_ids(PROMPTS, max_new_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    for full, cut, text in zip(free.tokens, stopped.tokens, stopped.texts):
        assert cut == (full[:full.index(stop_id)] if stop_id in full else full)
        assert text == chat.tokenizer.decode(cut)


def test_max_length_on_repeated_calls(chat):
    prompt = "Hello"  # 6 tokens with BOS
    lengths = [20, 9, 30, 12, 7]
    # counted in tokens: special and unused ids decode to several characters or none
    outs = [chat.generate_ids(prompt, max_length=n, ignore_eos=True).tokens[0] for n in lengths]
    assert [len(o) for o in outs] == [n - 6 for n in lengths]
    longest = max(outs, key=len)
    assert all(longest[:len(o)] == o for o in outs)
    assert chat.generate_ids(prompt, max_new_tokens=3, max_length=30, ignore_eos=True).tokens[0] == longest[:3]


def test_beam_search_with_one_beam_equals_greedy(chat):
    greedy = chat.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    beam = chat.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, sampler=kw.BeamSearch(num_beams=1))
    assert beam == greedy


def _exhaustive_best(lm, prompt, n_new, vocab):
    best, best_score = None, -math.inf
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n_new):
            ids = torch.cat([prompt, torch.tensor(seq)])
            logp = torch.log_softmax(lm(ids[None])[0, len(prompt) - 1:-1], -1)
            score = float(logp.gather(1, torch.tensor(seq)[:, None]).sum())
            if score > best_score:
                best, best_score = list(seq), score
    return best


def test_beam_search_finds_the_exhaustive_best_sequence():
    """With as many beams as tokens, every one-token prefix survives, so two-token search is exact."""
    lm = kw.from_hf(tiny_hf_gpt2(vocab_size=8, eos_token_id=None, bos_token_id=None, seed=3))
    beams, greedy_missed = kw.BeamSearch(num_beams=8, length_penalty=0.0), 0
    for seed in range(12):
        prompt = torch.randint(0, 8, (4,), generator=torch.Generator().manual_seed(seed))
        best = _exhaustive_best(lm, prompt, 2, 8)
        assert lm.generate(prompt, max_new_tokens=2, sampler=beams).tolist() == best
        greedy_missed += lm.generate(prompt, max_new_tokens=2).tolist() != best
    assert greedy_missed > 0, "every case was solved by greedy: the test would not catch a broken beam search"


def test_sampling_is_reproducible_with_a_seed(chat):
    sampler = kw.TopP(0.9, temperature=1.5)
    a = chat.generate(PROMPTS, max_new_tokens=15, sampler=sampler, seed=7, ignore_eos=True)
    b = chat.generate(PROMPTS, max_new_tokens=15, sampler=sampler, seed=7, ignore_eos=True)
    c = chat.generate(PROMPTS, max_new_tokens=15, sampler=sampler, seed=8, ignore_eos=True)
    assert a == b and a != c


def _chi_square_critical(df, z=3.09):
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("sampler", [kw.Random(0.8), kw.TopK(5, temperature=1.3), kw.TopP(0.7),
                                     kw.MinP(0.05, temperature=1.2)], ids=lambda s: type(s).__name__)
def test_sampled_distribution_matches_filtered_softmax(sampler):
    lm = kw.from_hf(tiny_hf_gpt2(vocab_size=16))
    with torch.no_grad():
        logits = lm(torch.tensor([[3, 1, 4, 1, 5]]))[0, -1] * 0.5  # moderate: several tokens likely
    expected = torch.softmax(sampler.filter(logits[None].float() / sampler.temperature), -1)[0]
    n = 20_000
    draws = sampler(logits.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=16).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a filtered-out token was sampled"
    assert support.sum() >= 3
    chi2 = float(((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    assert chi2 < _chi_square_critical(int(support.sum()) - 1)


def _three_character_tokens(lm, tokens, text):
    """(where, text) of the first three tokens that decode to one character each and whose text
    first occurs where they stand (special tokens decode to several characters: <pad>)."""
    pieces = [lm.tokenizer.decode([t]) for t in tokens]
    for k in range(len(tokens) - 2):
        at, stop = len("".join(pieces[:k])), "".join(pieces[k:k + 3])
        if all(len(p) == 1 for p in pieces[k:k + 3]) and text.find(stop) == at:
            return at, stop
    raise AssertionError(f"no three one-character tokens in {text!r}")


def test_stop_strings_spanning_tokens(chat):
    free = chat.generate_ids("Hello", max_new_tokens=20, ignore_eos=True)
    at, stop = _three_character_tokens(chat, free.tokens[0], free.texts[0])  # three characters: three tokens
    free = free.texts[0]
    cut = chat.generate("Hello", max_new_tokens=20, ignore_eos=True, stop=[stop, "\x00never"])
    assert cut == free[:at]
    gen = chat.generate("Hello", max_new_tokens=20, ignore_eos=True, stop=stop, return_logprobs=True)
    assert chat.tokenizer.decode(gen.tokens[0]) == cut


def test_stream_concatenation_equals_generate_with_multibyte_text(bytes_lm):
    split_chars = 0
    for seed in range(3):
        options = dict(max_new_tokens=40, sampler=kw.Random(1.0), seed=seed, ignore_eos=True)
        pieces = list(bytes_lm.stream("caf\u00e9 \u6771", **options))
        text = bytes_lm.generate("caf\u00e9 \u6771", **options)
        assert "".join(pieces) == text
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # no half-assembled character
        assert len(pieces) > 1
        tokens = bytes_lm.generate_ids("caf\u00e9 \u6771", **options).tokens[0]
        split_chars += sum(bytes_lm.tokenizer.decode(tokens[:k]).endswith("\ufffd") for k in range(len(tokens)))
    assert split_chars > 0, "no character spanned tokens: the hold-back path was not exercised"


def test_stream_holds_back_a_stop_string(chat):
    free = chat.generate("Hello", max_new_tokens=20, ignore_eos=True)
    stop = free[6:9]
    pieces = list(chat.stream("Hello", max_new_tokens=20, ignore_eos=True, stop=stop))
    assert "".join(pieces) == free[:free.find(stop)]


def test_score_equals_log_softmax_of_uncached_logits(chat):
    text = "Score this text."
    ids = torch.tensor(chat.tokenizer.encode(text))
    with torch.no_grad():
        logp = torch.log_softmax(chat(ids[None])[0], -1)
    expected = logp[:-1].gather(1, ids[1:, None])[:, 0]
    torch.testing.assert_close(chat.score(text), expected)
    torch.testing.assert_close(chat.score(ids), expected)
    assert chat.perplexity(text) == pytest.approx(math.exp(-float(expected.mean())), rel=1e-6)


def test_return_logprobs_are_the_chosen_tokens_log_probabilities(chat):
    gen = chat.generate("Hello", max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    ids = torch.tensor(chat.tokenizer.encode("Hello") + gen.tokens[0])
    with torch.no_grad():
        logp = torch.log_softmax(chat(ids[None])[0], -1)
    expected = logp[5:-1].gather(1, ids[6:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(gen.logprobs[0]), expected, atol=1e-4, rtol=0)
    assert gen.texts[0] == chat.tokenizer.decode(gen.tokens[0])


def test_records_without_logprobs_keep_the_tokens(chat):
    with_lp = chat.generate("Hello", max_new_tokens=6, ignore_eos=True, return_logprobs=True)
    *_, (_, without) = chat.stream_with_record("Hello", max_new_tokens=6, ignore_eos=True, logprobs=False)
    assert without.tokens == with_lp.tokens
    assert all(math.isnan(lp) for lp in without.logprobs[0]) and len(without.logprobs[0]) == 6


def test_greedy_argmax_matches_torch_on_ties_and_nan():
    from kvwire.generate.samplers import argmax

    logits = torch.randn(5, 1000)
    logits[1, [10, 700]] = 50.0  # a tie: the first index wins
    logits[2, 300] = float("nan")  # NaN counts as the largest, as torch's argmax has it
    logits[3] = 0.0
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert argmax(logits).tolist()[1:4] == [10, 300, 0]
    assert torch.equal(kw.Greedy()(logits.double()), logits.double().argmax(-1))


def test_repetition_penalty_discourages_repeats(chat):
    plain = chat.generate("aaaa", max_new_tokens=30, ignore_eos=True)
    penalised = chat.generate("aaaa", max_new_tokens=30, ignore_eos=True, repetition_penalty=5.0)
    assert len(set(penalised)) > len(set(plain)) or plain != penalised


@pytest.mark.parametrize("make,message", [
    (lambda: kw.Random(temperature=-1.0), "temperature must be a finite number > 0"),
    (lambda: kw.TopP(1.5), r"top_p must lie in \(0, 1\], got 1.5"),
    (lambda: kw.TopP(0.0), r"top_p must lie in \(0, 1\], got 0.0"),
    (lambda: kw.TopK(0), "top_k must be an int >= 1, got 0"),
    (lambda: kw.MinP(-0.1), r"min_p must lie in \[0, 1\], got -0.1"),
    (lambda: kw.BeamSearch(num_beams=0), "num_beams must be an int >= 1, got 0"),
])
def test_invalid_sampler_parameters(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_invalid_generation_options(chat):
    with pytest.raises(ValueError, match="num_beams=200 exceeds the vocabulary of 100 tokens"):
        chat.generate("Hi", sampler=kw.BeamSearch(num_beams=200))
    with pytest.raises(ValueError, match=r"stop strings must be non-empty str, got \(''"):
        chat.generate("Hi", stop=["", "x"])
    with pytest.raises(ValueError, match="max_length must be an int >= 1, got -3"):
        chat.generate("Hi", max_length=-3)
    with pytest.raises(ValueError, match="prompt has 3 tokens but max_length is 2"):
        chat.generate("Hi", max_length=2)
    with pytest.raises(TypeError, match="prompt must be a str, a non-empty list of str, a token-id tensor or a list of 1-D"):
        chat.generate(42)
    with pytest.raises(TypeError, match="sampler must be a kvwire sampler"):
        chat.generate("Hi", sampler="greedy")
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0, got 0"):
        chat.generate("Hi", repetition_penalty=0)


def test_interleaved_streams_do_not_share_caches(chat):
    alone = [chat.generate(p, max_new_tokens=10, ignore_eos=True) for p in ("Hello", "World")]
    chat.generate("warm the cache pool", max_new_tokens=20, ignore_eos=True)
    a = chat.stream("Hello", max_new_tokens=10, ignore_eos=True)
    b = chat.stream("World", max_new_tokens=10, ignore_eos=True)
    texts = ["", ""]
    for pa, pb in itertools.zip_longest(a, b, fillvalue=""):
        texts[0] += pa
        texts[1] += pb
    assert texts == alone


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45])
def test_a_temperature_float32_rounds_to_zero_samples_the_greedy_token(temperature):
    # float32 turns 5e-324 into 0: dividing by it made the maximum 0 / 0 = NaN and the row failed
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    for sampler in (kw.Random(temperature), kw.TopP(0.9, temperature=temperature)):
        assert sampler.sample_rows(logits, [torch.Generator().manual_seed(0)]).tolist() == [1]
