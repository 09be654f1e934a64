"""The real default model (Gemma 3 270M, Q4_K_M GGUF from a PyPI package) against transformers'
own GGUF loader on the same file. Marked `real`: these load the model twice and take minutes."""
import copy
from pathlib import Path

import pytest
import torch

import kvwire as kw

from .hf_gguf import transformers_gguf

pytestmark = pytest.mark.real

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.fixture(scope="module")
def gguf_path():
    from kvwire.models.presets import gemma3_270m

    return Path(gemma3_270m())


@pytest.fixture(scope="module")
def ours(default_lm):
    return default_lm


@pytest.fixture(scope="module")
def theirs(gguf_path):
    return transformers_gguf(gguf_path.parent, gguf_path.name)


def test_logits_match_transformers_gguf_loader(ours, theirs):
    model, tokenizer = theirs
    for text in PROMPTS:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        assert ids.tolist()[0] == ours.tokenizer.encode(text)
        with torch.no_grad():
            expected = model(ids).logits
            got = ours(ids)
        # float32 noise through 18 layers and a 262k-way head: measured max |diff| 4.1e-5 on logits
        # up to 34 (2026-11-30); the bound leaves 5x room.
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_32_greedy_tokens_match_transformers(ours, theirs):
    model, tokenizer = theirs
    for text in PROMPTS:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
        expected = out[0, ids.shape[1]:].tolist()
        got = ours.generate(ids[0], max_new_tokens=32).tolist()
        n = len(got)
        assert got == expected[:n]
        assert n == 32 or expected[n] in ours.tokenizer.eos_token_ids


TEXTS = ["Hello world", "  leading and   inner   spaces", "tabs\tand\nnewlines\n\n\nend", "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e",
         "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059", "emoji \U0001F600\U0001F680 ok",
         "<start_of_turn>user\nhi<end_of_turn>", "<bos> not really <eos>", "x" * 40 + " 12345 3.14159"]


def test_tokenizer_matches_transformers(ours, theirs):
    _, tokenizer = theirs
    for text in TEXTS:
        expected = tokenizer(text)["input_ids"]
        assert ours.tokenizer.encode(text) == expected, text
        assert ours.tokenizer.decode(expected[1:], skip_special_tokens=False) == text


def test_cached_past_the_sliding_window_matches_uncached(ours):
    """600 tokens (window 512), prefilled in chunks of 250 then decoded, vs the uncached forward."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20_000, (1, 604), generator=g)
    cached = ours.cached
    cache = cached.init_cache(1, 604)
    mask = torch.ones(1, 604, dtype=torch.bool)
    with torch.no_grad():
        expected = ours(ids)[0, -8:]
        start, got = 0, []
        for n in (250, 250, 96, 1, 1, 1, 1, 1, 1, 1, 1):
            h, cache = cached(ids[:, start:start + n], torch.arange(start, start + n)[None], start, mask, cache)
            got.append(ours.head(h[:, -min(n, 8):])[0])
            start += n
    got = torch.cat(got[-9:])[-8:]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


def test_batch_rows_equal_single_runs(ours):
    prompts = ["The capital of France is", "Water boils at", "In 1492, Columbus"]
    batch = ours.generate(prompts, max_new_tokens=12)
    assert batch == [ours.generate(p, max_new_tokens=12) for p in prompts]


def test_bfloat16_greedy_stays_close_to_float32(ours):
    """The reduced-precision path: most greedy tokens agree with float32 (measured, not assumed)."""
    half = kw.load("gemma3-270m", dtype="bfloat16", progress=False)
    prompt = "The history of the city of Paris begins"
    full = ours.generate(prompt, max_new_tokens=32, ignore_eos=True, return_logprobs=True).tokens[0]
    reduced = half.generate(prompt, max_new_tokens=32, ignore_eos=True, return_logprobs=True).tokens[0]
    agree = next((i for i, (a, b) in enumerate(zip(full, reduced)) if a != b), 32)
    assert agree >= 8, f"bfloat16 diverged from float32 after {agree} tokens"
    text = "Paris is the capital and most populous city of France. It is located on the Seine river."
    assert abs(half.perplexity(text) / ours.perplexity(text) - 1) < 0.05


def test_float16_generates_the_float32_tokens(ours):
    """Gemma 3's residual passes float16's 65504 after block 7; it stays float32 between blocks."""
    half = kw.load("gemma3-270m", dtype="float16", progress=False)
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[0])])
    logits = half(ids).float()
    assert logits.isfinite().all()
    assert (logits - ours(ids)).abs().max() < 0.2  # measured 0.029-0.039 of logits up to 26.6
    want = ours.generate(ids, max_new_tokens=16, ignore_eos=True, return_logprobs=True)
    got = half.generate(ids, max_new_tokens=16, ignore_eos=True)[0].tolist()
    # float16 rounding makes near-ties flip eventually (first difference seen at token 11 with one
    # thread, none in 16 with two): the first 8 agree, and float16 scores float32's continuation alike
    assert got[:8] == want.tokens[0][:8]
    full = torch.cat([ids, torch.tensor([want.tokens[0]])], dim=1)
    scores = torch.log_softmax(half(full).float()[0, :-1], -1).gather(1, full[0, 1:, None])[ids.shape[1] - 1:, 0]
    assert abs(float(scores.mean()) - sum(want.logprobs[0]) / 16) < 0.01  # measured 0.0005


def test_the_generic_path_equals_the_native_path_and_transformers(ours, theirs):
    """Gemma 3 forced through the generic path (transformers' own modules, kvwire's cache pass; its
    sliding layers as rings) gives the native decoder's greedy tokens, past the 512-token window
    too. A copy of transformers' model (not a second load of the file): the generic path sets the
    attention implementation of the model it wraps."""
    model, tokenizer = theirs
    generic = kw.from_hf(copy.deepcopy(model), generic=True)
    assert generic.family == "generic"
    assert {layer.window for layer in generic.backbone.layers} == {512, None}
    for text in PROMPTS:
        ids = torch.tensor(tokenizer(text)["input_ids"])
        assert generic.generate(ids, max_new_tokens=32).tolist() == ours.generate(ids, max_new_tokens=32).tolist()
    long = torch.tensor(ours.tokenizer.encode("The history of the city: " * 110))[:530]  # past the window
    assert generic.generate(long, max_new_tokens=8).tolist() == ours.generate(long, max_new_tokens=8).tolist()
