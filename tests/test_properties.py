"""Property tests (hypothesis): random tiny models of every family, random edits, prompts, batches
and chunkings; the cached graph must equal the uncached forward. Profiles, case counts and
reproduction: see the block at the end of tests/conftest.py (HYPOTHESIS_PROFILE=ci|local)."""
import functools

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvwire as kw

from .property_checks import ATOL, check_greedy
from .property_models import (EOS, control_vector, examples, layer_call_names, model, numbered, shifted_blocks, specs,
                              steered, token_rows)


def _chunks(data, n, pieces=6):
    """At most `pieces` chunk sizes summing to n: single tokens, chunks shorter and longer than any
    window (2-5); the last takes what is left."""
    sizes = []
    while sum(sizes) < n:
        left = n - sum(sizes)
        size = left if len(sizes) == pieces - 1 else data.draw(st.one_of(st.integers(1, 6), st.integers(1, left)),
                                                                 label="chunk")
        sizes.append(min(left, size))
    return sizes


def _chunked_run(data, lm, cached):
    """Draw a left-padded batch (rows, then up to 4 decoded tokens per row), a chunking, a start
    cache_index (the timeline before it masked) and maybe stale caches; run it through `cached`.
    Returns (ids (B, n), pads (B,), the graph's outputs per chunk)."""
    V = lm.vocab_size
    longest = data.draw(st.sampled_from([8, 24, 72]), label="longest")  # 72: the fused (flash) kernel too
    rows = data.draw(token_rows(V, max_len=longest), label="rows")
    B, L = len(rows), max(len(r) for r in rows)
    decoded = data.draw(st.lists(st.lists(st.integers(0, V - 1), min_size=B, max_size=B), max_size=4), label="decoded")
    offset, slack = data.draw(st.integers(0, 5), label="offset"), data.draw(st.integers(0, 3), label="slack")
    pad = data.draw(st.integers(0, V - 1), label="pad id")
    n = L + len(decoded)
    chunks = _chunks(data, n)

    pads = torch.tensor([L - len(r) for r in rows])
    ids = torch.full((B, n), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, int(pads[i]):L] = torch.tensor(r)
    if decoded:
        ids[:, L:] = torch.tensor(decoded).T
    positions = (torch.arange(n)[None] - pads[:, None]).clamp(min=0)
    max_length = offset + n + slack
    mask = torch.arange(max_length)[None] >= (offset + pads)[:, None]
    cache = cached.init_cache(B, max_length)
    if data.draw(st.booleans(), label="stale cache"):  # what a reused cache holds: must be masked out
        g = torch.Generator().manual_seed(len(chunks))
        for t in (t for pair in cache for t in pair):
            t.normal_(0.0, 3.0, generator=g)
    outs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            chunk = slice(start, start + size)
            out, cache = cached(ids[:, chunk], positions[:, chunk], offset + start, mask, cache)
            outs.append(out)
            start += size
    return ids, pads, outs


@settings(max_examples=examples(3.5))
@given(spec=specs(), data=st.data())
def test_chunked_cached_logits_equal_uncached(spec, data):
    """A left-padded batch fed through the cached graph in random chunks, starting at a random
    cache_index, on caches holding stale values: every row's logits equal the uncached forward of
    that row alone."""
    lm = model(spec)
    ids, pads, outs = _chunked_run(data, lm, lm.cached)
    with torch.no_grad():
        got = lm.head(torch.cat(outs, dim=1))
        for i, p in enumerate(pads.tolist()):
            torch.testing.assert_close(got[i, p:], lm(ids[i:i + 1, p:])[0], atol=ATOL, rtol=0)


@functools.lru_cache(maxsize=None)
def _tapped(spec, names):
    tapped = kw.tap(model(spec).backbone, list(names))
    return tapped, kw.with_cache(tapped)


@settings(max_examples=examples(1.0))
@given(spec=specs(), data=st.data())
def test_chunked_cached_taps_equal_uncached(spec, data):
    """`kw.tap` of random calls (inserted ones too), cached and run like the test above: every
    tapped output of every row equals the uncached tap of that row alone."""
    calls = layer_call_names(spec)
    names = tuple(sorted(data.draw(st.sets(st.sampled_from(calls), min_size=1, max_size=3), label="taps")))
    tapped, cached = _tapped(spec, names)
    ids, pads, outs = _chunked_run(data, model(spec), cached)
    with torch.no_grad():
        for i, p in enumerate(pads.tolist()):
            _, alone = tapped(ids[i:i + 1, p:])
            assert set(alone) == set(outs[0][1])
            for name, value in alone.items():
                got = torch.cat([taps[name] for _, taps in outs], dim=1)
                torch.testing.assert_close(got[i, p:], value[0], atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")


@settings(max_examples=examples(3.0))
@given(spec=specs(), data=st.data())
def test_cached_greedy_equals_uncached_rollout(spec, data):
    """`generate` (left-padded batch, cached prefill and decode, caches kept between calls) gives
    every row the uncached argmax rollout and its log-probabilities, ending at EOS (unless ignored)
    and at extra stop ids, with or without a repetition penalty."""
    lm = model(spec)
    V = lm.vocab_size
    rows = data.draw(token_rows(V), label="rows")
    new, ignore_eos = data.draw(st.integers(1, 8), label="new"), data.draw(st.booleans(), label="ignore_eos")
    stop_ids = data.draw(st.lists(st.integers(0, V - 1), max_size=2), label="stop_token_ids")
    as_tensor = data.draw(st.booleans(), label="stop ids as a tensor")
    penalty = data.draw(st.none() | st.sampled_from([0.2, 0.5, 1.5, 3.0]), label="repetition_penalty")
    prompts = [torch.tensor(r) for r in rows]
    stop_token_ids = torch.tensor(stop_ids, dtype=torch.long) if as_tensor else stop_ids
    options = dict(ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, repetition_penalty=penalty)
    if data.draw(st.booleans(), label="by max_length"):
        gen = lm.generate_ids(prompts, max_length=max(map(len, rows)) + new, **options)
    else:
        gen = lm.generate_ids(prompts, new, **options)
    stops = set(stop_ids) | (set() if ignore_eos else {EOS})
    for row, tokens, logprobs in zip(rows, gen.tokens, gen.logprobs):
        check_greedy(lm, row, tokens, logprobs, new, stops, penalty)


@settings(max_examples=examples(2.0))
@given(spec=specs(), data=st.data())
def test_steered_generation_equals_uncached_per_row(spec, data):
    """Control vectors with one strength per row, given to `steer` (a number or a (B,) tensor) or
    as `inputs=` at generate time; a second vector stacked under its own input name (steer's
    default or a given one); all positions or generated ones only; blocks addressed by their
    numbers after any edits: each row generates what the unsteered model generates uncached with
    that row's shifts added after those blocks (hooks)."""
    lm, blocks = model(spec), sorted(numbered(spec))
    assume(blocks)  # every block skipped or replaced: nothing to steer
    layers = tuple(sorted(data.draw(st.sets(st.sampled_from(blocks), min_size=1), label="layers")))
    seed = data.draw(st.integers(0, 3), label="vector seed")
    generated_only = data.draw(st.booleans(), label="generated_only")
    second_name = data.draw(st.sampled_from([None, "other"]), label="second name")
    rows = data.draw(token_rows(lm.vocab_size), label="rows")
    B, strength = len(rows), st.floats(-3.0, 3.0, allow_subnormal=False)
    mode = data.draw(st.sampled_from(["number", "per row", "inputs"]), label="mode")
    if mode == "inputs":
        firsts, seconds = (data.draw(st.lists(strength, min_size=B, max_size=B), label=k) for k in ("first", "second"))
        steered_lm, vector = steered(spec, layers, seed, generated_only, second_name)
        inputs = {"steer_strength": torch.tensor(firsts), f"{second_name or 'steer2'}_strength": torch.tensor(seconds)}
    else:
        vector, inputs = control_vector(lm, layers, seed), None
        if mode == "number":
            firsts = [data.draw(strength, label="strength")] * B
            steered_lm = lm.steer(vector, firsts[0], generated_only=generated_only)
        else:
            firsts = data.draw(st.lists(strength, min_size=B, max_size=B), label="strengths")
            steered_lm = lm.steer(vector, torch.tensor(firsts), generated_only=generated_only)
        second = data.draw(st.none() | strength, label="second strength")
        seconds = [0.0 if second is None else second] * B
        if second is not None:
            steered_lm = steered_lm.steer(vector * -0.5, second, generated_only=generated_only, name=second_name)
    new = data.draw(st.integers(1, 6), label="new")
    gen = steered_lm.generate_ids([torch.tensor(r) for r in rows], new, ignore_eos=True, inputs=inputs)
    for row, s1, s2, tokens, logprobs in zip(rows, firsts, seconds, gen.tokens, gen.logprobs):
        with shifted_blocks(spec, vector, s1, s2, start=len(row) if generated_only else 0) as reference:
            check_greedy(reference, row, tokens, logprobs, new)
