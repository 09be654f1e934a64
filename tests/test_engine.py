"""The engine: rows joining and leaving a running batch (per-row cache index), per-row seeds and
steering, prefix reuse, cancellation and failing rows. Reference: single runs of `generate`."""
import random

import pytest
import torch

import kvwire as kw
from kvwire.generate import Engine, PrefixStore
from kvwire.generate.prefix import _Pool
from kvwire.steer import ControlVector

from .conftest import FAMILIES

# a ring cache (gemma3: sliding layers of window 4; mistral: every layer), learned positions (gpt2),
# full-length caches with GQA (llama)
KINDS = ["gemma3", "mistral", "gpt2", "llama"]


def tiny(family, seed=0):
    return kw.from_hf(FAMILIES[family](seed=seed))


def filled_cache(lm, row, length):
    """A one-row cache of `length` slots holding the keys/values of `row`; (cache, bytes a
    token's keys and values take over all layers, float32)."""
    cache = lm.cached.init_cache(1, length)
    n = len(row)
    lm.cached(torch.tensor([row]), torch.arange(n)[None], 0, torch.ones(1, length, dtype=torch.bool), cache)
    return cache, sum(k[0, :, :1].numel() * 4 * 2 for k, _ in cache)


def prompts(n, seed=0, low=3, high=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def single(lm, prompt, new, **options):
    """Reference: the prompt alone through generate (a batch of one)."""
    gen = lm.generate(torch.tensor(prompt), max_new_tokens=new, ignore_eos=True, return_logprobs=True, **options)
    return gen.tokens[0], gen.logprobs[0]


def drive(engine, seqs, steps=None):
    for i, _ in enumerate(engine.run(seqs)):
        if steps is not None and i + 1 >= steps:
            return


@pytest.mark.parametrize("family", KINDS)
def test_per_row_cache_index_equals_rows_run_alone(family):
    """The cached graph with cache_index (B,): rows at different places of their timelines (and
    chunks of several tokens) give each row's own single-row result, eagerly and functionally
    (the update compilers and exporters trace)."""
    lm = tiny(family)
    cached, L = lm.cached, 40
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 96, (n,), generator=g) for n in (3, 11)]
    chunks = [[torch.randint(3, 96, (k,), generator=g) for k in (1, 4, 1, 7)] for _ in rows]

    def alone(p, extra):
        cache, mask = cached.init_cache(1, L), torch.ones(1, L, dtype=torch.bool)
        _, cache = cached(p[None], torch.arange(len(p))[None], 0, mask, cache)
        outs, at = [], len(p)
        for t in extra:
            h, cache = cached(t[None], torch.arange(at, at + len(t))[None], at, mask, cache)
            outs.append(h[0])
            at += len(t)
        return outs, cache

    expected = [alone(p, e)[0] for p, e in zip(rows, chunks)]
    gm = cached.graph_module
    functional = torch.compile(lambda *a: gm(*a), backend="eager", dynamic=False)
    for run in ("eager", "functional"):
        parts = [alone(p, [])[1] for p in rows]
        cache = tuple(tuple(torch.cat([a[j], b[j]]) for j in range(2)) for a, b in zip(*parts))
        index, mask = torch.tensor([len(p) for p in rows]), torch.ones(2, L, dtype=torch.bool)
        for step in range(4):
            ids = torch.stack([chunks[0][step], chunks[1][step]])
            positions = index[:, None] + torch.arange(ids.shape[1])
            if run == "eager":
                h, cache = cached(ids, positions, index, mask, cache)
            else:
                h, cache = functional(ids, positions, index, mask, cache, *cached.runtime_values(2, {}))
            index = index + ids.shape[1]
            for r in range(2):
                torch.testing.assert_close(h[r], expected[r][step], atol=1e-4, rtol=1e-4)


def test_a_bad_per_row_cache_index_is_a_clear_error():
    lm = tiny("llama")
    cache, mask = lm.cached.init_cache(2, 8), torch.ones(2, 8, dtype=torch.bool)
    ids = torch.ones(2, 1, dtype=torch.long)
    with pytest.raises(TypeError, match=r"cache_index must be an int .* or an int64 tensor of shape \(\) or \(B=2,\)"):
        lm.cached(ids, ids, torch.tensor([1, 2, 3]), mask, cache)
    with pytest.raises(ValueError, match=r"chunk of 1 tokens at cache_index 8 does not fit max_length 8"):
        lm.cached(ids, ids, torch.tensor([1, 8]), mask, cache)


@pytest.mark.parametrize("family", KINDS)
def test_rows_joining_and_leaving_mid_generation_equal_single_runs(family):
    """Greedy rows equal their single runs while others join (prefilled in chunks into a scratch
    cache while the batch decodes) and leave (freeing their row for a waiting one)."""
    lm = tiny(family)
    rows = prompts(5, seed=2)
    budgets = [12, 3, 9, 5, 7]
    engine = Engine(lm, max_batch=3, max_length=40, prefill_chunk=4)
    first = engine.submit(rows[0], budgets[0], label="a")
    drive(engine, [first], steps=3)
    later = [engine.submit(r, n) for r, n in zip(rows[1:3], budgets[1:3])]
    drive(engine, [first], steps=2)
    waiting = [engine.submit(r, n) for r, n in zip(rows[3:], budgets[3:])]  # more than the free rows
    seqs = [first, *later, *waiting]
    drive(engine, seqs)
    assert engine.idle
    # the test exercised what it is about: joins while decoding, rows at different indices
    assert engine.stats["scratch_prefills"] >= 3 and engine.stats["per_row_steps"] > 5
    for seq, row, n in zip(seqs, rows, budgets):
        tokens, logprobs = single(lm, row, n)
        assert seq.tokens == tokens, (seq, row)
        assert seq.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


def test_a_rows_seeded_sampling_does_not_depend_on_the_batch():
    lm = tiny("gemma3")
    rows = prompts(3, seed=3)
    sampler = kw.TopP(0.95, temperature=1.5)
    alone = Engine(lm, max_batch=1, max_length=40)
    seq = alone.submit(rows[0], 10, sampler=sampler, seed=7)
    drive(alone, [seq])
    crowded = Engine(lm, max_batch=3, max_length=40)
    others = [crowded.submit(rows[1], 6, sampler=kw.Random(), seed=1)]
    drive(crowded, others, steps=2)
    again = crowded.submit(rows[0], 10, sampler=sampler, seed=7)
    others.append(crowded.submit(rows[2], 10, sampler=sampler, seed=8))
    drive(crowded, [again, *others])
    assert again.tokens == seq.tokens
    assert others[1].tokens != seq.tokens  # another seed, other tokens (the test could tell)
    # and generate's batch rows draw from seed + i: row 0 of a batch is the single run
    batch = lm.generate([torch.tensor(rows[0]), torch.tensor(rows[2])], max_new_tokens=10, sampler=sampler, seed=7,
                        ignore_eos=True)
    assert batch[0].tolist() == lm.generate(torch.tensor(rows[0]), max_new_tokens=10, sampler=sampler, seed=7,
                                            ignore_eos=True).tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefix_reuse_equals_a_full_prefill(family):
    """A prompt that extends a finished sequence (a conversation's next turn) reuses its keys and
    values: same tokens and log-probabilities as prefilling everything, fewer tokens prefilled."""
    lm = tiny(family)
    store = PrefixStore(min_tokens=4)
    engine = Engine(lm, max_batch=2, max_length=64, prefix_store=store)
    turn1 = prompts(1, seed=4, low=10, high=11)[0]
    a = engine.submit(turn1, 8)
    drive(engine, [a])
    assert len(store) == 1
    turn2 = turn1 + a.tokens + [5, 6, 7, 8, 9]
    b = engine.submit(turn2, 8)
    drive(engine, [b])
    # the ring layers of gemma3 keep only their window: reuse needs the whole stored sequence
    assert b.cached_tokens == len(turn1) + len(a.tokens) - 1  # the last token was never fed
    tokens, logprobs = single(lm, turn2, 8)
    assert b.tokens == tokens
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
    assert store.hits == 1


def test_a_sequence_cancelled_during_its_last_step_is_not_stored(monkeypatch):
    # a server gives a request's inline slots back when its client leaves, on another thread, maybe
    # in the middle of the step that ends the sequence: its keys/values are then not its key's
    lm = tiny("llama")
    store = PrefixStore(min_tokens=4)
    engine = Engine(lm, max_batch=1, max_length=64, prefix_store=store)
    prompt = prompts(1, seed=5, low=10, high=11)[0]
    seq = engine.submit(prompt, 4)
    decode = engine._decode

    def leaving():
        if len(seq.tokens) == 3:  # the step that samples its last token
            seq.cancel()
        return decode()
    monkeypatch.setattr(engine, "_decode", leaving)
    drive(engine, [seq])
    assert seq.done and len(store) == 0
    again = engine.submit(prompt, 4)
    drive(engine, [again])
    assert len(store) == 1  # one not cancelled is stored


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefix_hits_waiting_together_prefill_as_one_batch(family):
    """Prompts extending one stored sequence, submitted together, prefill in one batch where their
    entries can be restored up to where the batch's longest new part starts (full caches: any
    length; gemma3's rings only at the stored length, so only equal new parts batch), unless the
    batch would compute more than twice the new tokens; each row equals its prompt prefilled alone."""
    lm = tiny(family)
    store = PrefixStore(min_tokens=4)
    engine = Engine(lm, max_batch=4, max_length=128, prefix_store=store)
    first = engine.submit(prompts(1, seed=4, low=12, high=13)[0], 8)
    drive(engine, [first])
    stored = first.prompt + first.tokens[:-1]  # the last token was never fed
    suffixes = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18], [20 + i % 50 for i in range(40)]]
    if family == "gemma3":
        suffixes[1] = [8, 9, 10]  # the new part of row 0 (rings: equal new parts only)
    turns = [first.prompt + first.tokens + extra for extra in suffixes]
    before = engine.stats["scratch_prefills"] + engine.stats["direct_prefills"]
    direct = engine.stats["direct_prefills"]
    seqs = [engine.submit(t, 6) for t in turns]
    drive(engine, seqs)
    for seq, turn in zip(seqs, turns):
        tokens, logprobs = single(lm, turn, 6)
        assert seq.tokens == tokens
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
    full = len(stored)
    if family == "llama":  # rows 0-2 batch from the column of row 1's new part (7 tokens); row 3 alone
        assert [s.cached_tokens for s in seqs] == [full - 3, full - 0, full - 1, full]
        assert engine.stats["scratch_prefills"] + engine.stats["direct_prefills"] - before == 2
    else:  # rows 0 and 1 batch; row 2's new part is longer and its rings hold only the stored end
        assert [s.cached_tokens for s in seqs] == [full] * 4
        assert engine.stats["scratch_prefills"] + engine.stats["direct_prefills"] - before == 3
    # the first batch found the engine idle: restored straight into its rows; the others joined it
    assert engine.stats["direct_prefills"] - direct == 1


def test_a_waiting_hit_whose_entry_was_evicted_is_looked_up_again():
    """A sequence looked up while it waited (a batch of hits looks behind the queue's head) whose
    entry is evicted before it is admitted looks up again, never restores freed pages."""
    lm = tiny("llama")
    store = PrefixStore(min_tokens=4)
    engine = Engine(lm, max_batch=1, max_length=64, prefix_store=store)
    first = engine.submit(prompts(1, seed=2, low=10, high=11)[0], 4)
    drive(engine, [first])
    waiting = engine.submit(first.prompt + first.tokens + [9], 4)
    entry, reused = engine._lookup(waiting)
    assert entry is not None and reused > 0
    store._drop((entry.tokens, entry.inputs))  # evicted while it waited
    assert engine._lookup(waiting) == (None, 0)
    drive(engine, [waiting])
    assert waiting.cached_tokens == 0 and waiting.tokens == single(lm, waiting.prompt, 4)[0]


def test_a_one_slot_state_takes_a_one_position_page():
    """A layer of fewer slots than a page (a state slot: one) stores in pages of that many positions:
    its bytes are its own, not a 16-position page's; it restores what was stored."""
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(1, 2, 32, 8, generator=g), torch.randn(1, 2, 32, 8, generator=g))
    state = (torch.randn(1, 1, 1, 5, generator=g), torch.randn(1, 1, 1, 3, generator=g))
    store = PrefixStore(min_tokens=4, page_tokens=16)
    tokens = list(range(3, 23))  # 20 positions
    store.store([full, state], 0, 0, tokens, ())
    entry, c = store.lookup(tokens + [1], (), [32, 1])
    assert c == 20
    assert entry.nbytes == 2 * 16 * 2 * (8 + 8) * 4 + 1 * 1 * (5 + 3) * 4  # two 16-position pages; one 1-position
    assert store.nbytes == entry.nbytes
    into = [tuple(torch.zeros_like(t) for t in full), tuple(torch.zeros_like(t) for t in state)]
    store.restore(entry, c, into, 0, 0)
    assert torch.equal(into[0][0][:, :, :20], full[0][:, :, :20]) and torch.equal(into[1][0], state[0])
    assert torch.equal(into[1][1], state[1])


def test_prefix_store_keeps_its_budget_and_respects_inputs():
    lm = tiny("llama")
    row = prompts(1, seed=5, low=20, high=21)[0]
    cache, per_token = filled_cache(lm, row, 32)
    store = PrefixStore(max_bytes=per_token * 30, min_tokens=4, page_tokens=5)
    store.store(cache, 0, 0, row, ())
    store.store(cache, 0, 0, row[:15], (("steer_strength", 1.0),))
    assert len(store) == 1 and store.nbytes == per_token * 15  # the first was evicted for the second
    slots = [32] * len(cache)
    assert store.lookup(row + [1], (), slots) == (None, 0)  # other inputs: not reused
    entry, c = store.lookup(row + [1], (("steer_strength", 1.0),), slots)
    assert c == 15 and entry.tokens == tuple(row[:15])
    store.store(cache, 0, 0, row[:11], ())  # 11 positions take 3 pages of 5: 15 positions' bytes
    assert len(store) == 2 and store.nbytes == per_token * 30


def test_per_request_steering_shares_the_batch():
    """Rows with different strengths of two named vectors, run together, equal each run alone."""
    lm = tiny("gemma3")
    g = torch.Generator().manual_seed(0)
    vec = lambda: ControlVector({i: torch.randn(32, generator=g) for i in range(4)})  # noqa: E731
    served = lm.steer(vec(), 0.0, name="happy").steer(vec(), 0.0, name="formal")
    choices = [{}, {"happy_strength": 2.0}, {"formal_strength": -1.5, "happy_strength": 0.5}]
    rows = prompts(3, seed=6)
    engine = Engine(served, max_batch=3, max_length=40)
    seqs = [engine.submit(r, 8, inputs=c) for r, c in zip(rows, choices)]
    drive(engine, seqs)
    for seq, row, choice in zip(seqs, rows, choices):
        inputs = {k: torch.tensor([v]) for k, v in choice.items()}
        assert seq.tokens == single(served, row, 8, inputs=inputs)[0]
    assert seqs[1].tokens != single(served, rows[1], 8)[0]  # steering changed something


def test_cancel_frees_the_row_without_disturbing_others():
    lm = tiny("mistral")
    rows = prompts(3, seed=7)
    engine = Engine(lm, max_batch=2, max_length=40)
    a, b = engine.submit(rows[0], 10), engine.submit(rows[1], 10)
    drive(engine, [a, b], steps=3)
    b.cancel()
    c = engine.submit(rows[2], 6)  # waits for b's row
    drive(engine, [a, c])
    assert b.finish_reason == "cancelled" and len(b.tokens) < 10
    assert a.tokens == single(lm, rows[0], 10)[0]
    assert c.tokens == single(lm, rows[2], 6)[0]


def test_a_failing_row_ends_alone_with_a_clear_error():
    lm = tiny("llama")
    g = torch.Generator().manual_seed(0)
    served = lm.steer(ControlVector({i: torch.randn(32, generator=g) for i in range(4)}), 0.0, name="s")
    rows = prompts(2, seed=8)
    engine = Engine(served, max_batch=2, max_length=40)
    bad = engine.submit(rows[0], 8, inputs={"s_strength": 3e38}, label="request 7")  # finite, overflows
    good = engine.submit(rows[1], 8)
    drive(engine, [bad, good])
    assert bad.finish_reason == "error" and bad.tokens == []
    assert isinstance(bad.error, FloatingPointError)
    assert "non-finite logits (nan) in request 7 at generation step 0" in str(bad.error)
    assert good.tokens == single(served, rows[1], 8)[0]


def test_bad_requests_are_refused_at_submit():
    lm = tiny("llama")
    engine = Engine(lm, max_batch=1, max_length=16)
    with pytest.raises(ValueError, match=r"prompt \(12 tokens\) \+ 8 new tokens exceeds this engine's max_length of 16"):
        engine.submit(list(range(3, 15)), 8)
    with pytest.raises(ValueError, match=r"unknown runtime inputs \['happy_strength'\]; this model takes none"):
        engine.submit([3, 4], 2, inputs={"happy_strength": 1.0})
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.submit([], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        engine.submit([3], 0)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1, got 0"):
        Engine(lm, max_batch=0)
    assert engine.idle  # nothing was queued


def test_a_server_thread_serves_submissions_from_other_threads_and_survives_a_failing_step():
    import threading

    lm = tiny("gemma3")
    rows = prompts(4, seed=9)
    engine = Engine(lm, max_batch=2, max_length=40)
    stop = threading.Event()
    worker = threading.Thread(target=engine.serve_forever, args=(stop,), daemon=True)
    worker.start()
    try:
        finished = []
        done = threading.Event()

        def listener(seq):
            if seq.done:
                finished.append(seq)
                if len(finished) == 3:
                    done.set()

        seqs = [engine.submit(r, 6, listener=listener) for r in rows[:3]]
        assert done.wait(60)
        for seq, row in zip(seqs, rows):
            assert seq.tokens == single(lm, row, 6)[0]
        # a step that raises ends what it was running with that error, and the engine goes on
        original = engine._decode
        calls = []

        def broken():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("kernel failure")
            original()

        engine._decode = broken
        failing = engine.submit(rows[3], 6)
        while not failing.done:
            threading.Event().wait(0.01)
        assert failing.finish_reason == "error" and "kernel failure" in str(failing.error)
        after = engine.submit(rows[3], 6)
        while not after.done:
            threading.Event().wait(0.01)
        assert after.tokens == single(lm, rows[3], 6)[0]
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()


def test_prefix_pages_are_reused_and_never_shared():
    """Entries of random lengths stored and evicted through a small budget: every surviving entry
    restores exactly the keys/values it was stored from (no page given to two entries), the pages
    in use add up to the store's bytes, and the buffers are the ones allocated at the first store."""
    lm = tiny("gemma3")  # full and ring layers: entries keep different positions per layer
    rng = random.Random(0)
    store = PrefixStore(max_bytes=200_000, min_tokens=1, page_tokens=4)
    caches, buffers = {}, None
    for i in range(40):
        n = rng.randint(1, 40)
        row = [rng.randrange(3, 96) for _ in range(n)]
        cache, _ = filled_cache(lm, row, 48)
        store.store(cache, 0, 0, row, (("i", i),))
        caches[(tuple(row), (("i", i),))] = (n, cache)
        if buffers is None:
            buffers = {key: pool.keys.data_ptr() for key, pool in store.pools.items()}
        for (tokens, inputs), entry in store.entries.items():
            m, original = caches[(tokens, inputs)]
            out = lm.cached.init_cache(1, 48)
            store.restore(entry, m, out, 0, 0)
            for (first, _, _), (k, v), (k2, v2) in zip(entry.layers, original, out):
                S = k.shape[2]
                slots = (torch.arange(first, m)) % S
                assert torch.equal(k2[0][:, slots], k[0][:, slots]) and torch.equal(v2[0][:, slots], v[0][:, slots])
        held = sum(len(pages) * pool.page_bytes for e in store.entries.values() for _, pool, pages in e.layers)
        assert held == store.nbytes <= 200_000
        used = [(id(pool), p) for e in store.entries.values() for _, pool, pages in e.layers for p in pages.tolist()]
        assert len(used) == len(set(used))
        assert {key: pool.keys.data_ptr() for key, pool in store.pools.items()} == buffers
    assert len(store) < 40  # the budget evicted some
    free = sum(len(pool.free) for pool in store.pools.values())
    capacity = sum(pool.keys.shape[0] // pool.page_tokens for pool in store.pools.values())  # small rings: small pages
    assert free + len(used) == capacity


def test_a_failed_store_keeps_its_pages_and_an_evicted_entry_is_not_restored():
    lm = tiny("llama")
    row = prompts(1, seed=6, low=20, high=21)[0]
    cache, per_token = filled_cache(lm, row, 32)
    store = PrefixStore(max_bytes=per_token * 20, min_tokens=4, page_tokens=4)
    store.store(cache, 0, 0, row[:8], ())
    entry, _ = store.lookup(row[:8] + [1], (), [32] * len(cache))
    free = [len(p.free) for p in store.pools.values()]
    broken = list(cache)
    broken[-1] = (cache[-1][0], cache[-1][1][:, :, :3])  # the last layer's values lack the positions to store
    with pytest.raises(RuntimeError):
        store.store(broken, 0, 0, row[:12], (("other", 1),))
    assert [len(p.free) for p in store.pools.values()] == free and len(store) == 1
    store.store(cache, 0, 0, row[:16], (("other", 1),))  # evicts the first entry for room
    assert len(store) == 1 and not entry.alive
    with pytest.raises(RuntimeError, match="was evicted"):
        store.restore(entry, 8, lm.cached.init_cache(1, 32), 0, 0)


def test_a_store_that_cannot_allocate_its_buffer_serves_on_without_reuse():
    lm = tiny("llama")
    store = PrefixStore(max_bytes=1 << 62, min_tokens=4)  # no machine backs 4 EiB
    engine = Engine(lm, max_batch=1, max_length=32, prefix_store=store)
    row = prompts(1, seed=7, low=10, high=11)[0]
    with pytest.warns(RuntimeWarning, match="could not allocate"):
        a = engine.submit(row, 4)
        drive(engine, [a])
    b = engine.submit(row + a.tokens + [5], 4)
    drive(engine, [b])
    assert len(store) == 0 and b.cached_tokens == 0 and b.tokens == single(lm, row + a.tokens + [5], 4)[0]


def test_a_store_that_raises_ends_reuse_not_the_sequence(monkeypatch):
    lm = tiny("llama")
    store = PrefixStore(max_bytes=1 << 24, min_tokens=4)
    engine = Engine(lm, max_batch=2, max_length=32, prefix_store=store)
    row = prompts(1, seed=8, low=10, high=11)[0]
    a = engine.submit(row, 4)
    drive(engine, [a])
    assert len(store) == 1

    def broken(*args):
        raise ValueError("a bug in the store")
    monkeypatch.setattr(store, "store", broken)
    b, c = engine.submit(row + [3, 4], 4), engine.submit(prompts(1, seed=9)[0], 3)
    with pytest.warns(RuntimeWarning, match="failed to store a sequence .ValueError: a bug in the store"):
        drive(engine, [b, c])
    assert b.error is None and b.tokens == single(lm, row + [3, 4], 4)[0]
    assert c.error is None and c.tokens == single(lm, c.prompt, 3)[0]
    assert store.disabled == "ValueError: a bug in the store" and len(store) == 0
    monkeypatch.undo()
    for served in (engine, Engine(lm, max_batch=1, max_length=32, prefix_store=store)):  # every user of it
        d = served.submit(row + a.tokens + [5], 4)
        drive(served, [d])
        assert d.cached_tokens == 0 and d.tokens == single(lm, row + a.tokens + [5], 4)[0] and len(store) == 0


def test_a_store_out_of_memory_skips_that_sequence_only(monkeypatch):
    lm = tiny("llama")
    store = PrefixStore(max_bytes=1 << 24, min_tokens=4)
    engine = Engine(lm, max_batch=1, max_length=32, prefix_store=store)
    row = prompts(1, seed=10, low=10, high=11)[0]
    take, calls = _Pool.take, []

    def out_of_memory(pool, n):  # the second layer's copy runs out, after the first took its pages
        calls.append(n)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("no memory for the copy")
        return take(pool, n)
    monkeypatch.setattr(_Pool, "take", out_of_memory)
    a = engine.submit(row, 4)
    with pytest.warns(RuntimeWarning, match="ran out of memory"):
        drive(engine, [a])
    assert a.error is None and len(store) == 0 and store.disabled is None
    assert [len(p.free) for p in store.pools.values()] == [p.keys.shape[0] // p.page_tokens
                                                           for p in store.pools.values()]  # pages given back
    monkeypatch.setattr(_Pool, "take", take)
    b = engine.submit(row + [3], 4)
    drive(engine, [b])
    c = engine.submit(row + [3] + b.tokens + [5], 2)
    drive(engine, [c])
    assert c.cached_tokens > 0 and c.tokens == single(lm, row + [3] + b.tokens + [5], 2)[0]


def test_a_longer_turn_replaces_the_stored_turns_it_extends():
    lm = tiny("llama")
    row = prompts(1, seed=10, low=20, high=21)[0]
    cache, _ = filled_cache(lm, row, 32)
    store = PrefixStore(min_tokens=4)
    store.store(cache, 0, 0, row[:10], ())
    store.store(cache, 0, 0, row[:5] + [1, 2], ())  # another branch: kept
    store.store(cache, 0, 0, row, ())
    assert sorted(len(t) for t, _ in store.entries) == [7, 20]


def test_compiled_decode_steps_serve_rows_that_join_later():
    """A compiled model's decode steps switch from one cache index (a batch admitted together) to
    one per row when a row joins: a signature of its own, not guards skipped for the old one. The
    rows still equal their single runs."""
    lm = tiny("gemma3").compile(backend="eager", bucket=8)
    rows = prompts(3, seed=11)
    engine = Engine(lm, max_batch=2, max_length=32)
    a, b = engine.submit(rows[0], 12), engine.submit(rows[1], 3)
    drive(engine, [b])
    assert engine.stats["per_row_steps"] == 0  # in step: one index
    c = engine.submit(rows[2], 6)
    drive(engine, [a, c])
    assert engine.stats["per_row_steps"] > 0
    assert {tuple(key[1][2][0]) for key in lm._decode.seen} == {(), (2,)}  # cache index shapes (3rd tensor)
    plain = tiny("gemma3")
    for seq, row, n in ((a, rows[0], 12), (b, rows[1], 3), (c, rows[2], 6)):
        assert seq.tokens == single(plain, row, n)[0]


def test_bad_values_are_refused_at_submit_not_inside_a_step():
    lm = tiny("llama")
    g = torch.Generator().manual_seed(0)
    served = lm.steer(ControlVector({i: torch.randn(32, generator=g) for i in range(4)}), 0.0, name="s")
    engine = Engine(served, max_batch=1, max_length=16)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\); got values in \[3, 96\]"):
        engine.submit([3, 96], 2)
    with pytest.raises(TypeError, match="runtime input 's_strength' must be a number, got 'high'"):
        engine.submit([3], 2, inputs={"s_strength": "high"})
    with pytest.raises(ValueError, match="must be a finite float32 number, got nan"):
        engine.submit([3], 2, inputs={"s_strength": float("nan")})
    assert engine.idle


def test_given_and_default_inputs_share_prefix_entries():
    lm = tiny("llama")
    g = torch.Generator().manual_seed(0)
    served = lm.steer(ControlVector({i: torch.randn(32, generator=g) for i in range(4)}), 0.0, name="s")
    store = PrefixStore(min_tokens=4)
    engine = Engine(served, max_batch=1, max_length=48, prefix_store=store)
    row = prompts(1, seed=12, low=10, high=11)[0]
    a = engine.submit(row, 4)
    drive(engine, [a])
    b = engine.submit(row + a.tokens + [7, 8], 4, inputs={"s_strength": 0.0})
    drive(engine, [b])
    assert b.cached_tokens > 0
    c = engine.submit(row + a.tokens + [7, 8], 4, inputs={"s_strength": 1.0})
    drive(engine, [c])
    assert c.cached_tokens == 0  # steered keys/values are others


def test_a_serving_engine_gives_freed_memory_back_on_its_schedule(monkeypatch):
    import threading
    import time

    from kvwire.generate import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "give_back_freed_memory", lambda: calls.append(time.monotonic()))
    engine = Engine(tiny("gemma3"), max_batch=2, max_length=40)
    stop = threading.Event()
    worker = threading.Thread(target=engine.serve_forever, args=(stop,), kwargs={"trim_every": 0.1}, daemon=True)
    worker.start()
    seq = engine.submit([3, 4, 5], 4)  # served while the schedule runs: idle polls and steps alike
    time.sleep(0.6)
    stop.set()
    worker.join(10)
    assert seq.done and len(seq.tokens) == 4
    assert 2 <= len(calls) <= 8  # about every 0.1 s of 0.6 s; not every poll (0.05 s, 12) or step


def test_submit_reads_no_parameter_while_another_thread_traces():
    """A server submits on its event loop while a vector may be training on another thread; torch.fx
    patches nn.Module.__getattr__ process-wide during a trace, so a Parameter read there (the head's
    weight, for the vocabulary size) would be a Proxy and the request would fail."""
    lm = kw.from_hf(FAMILIES["llama"]())
    engine = Engine(lm, max_batch=2, max_length=32)
    submitted = []

    class Submits(torch.nn.Module):  # traced with the backbone inside, as training traces it
        def __init__(self):
            super().__init__()
            self.backbone = lm.backbone

        def forward(self, x):
            submitted.append(engine.submit([3, 17, 42], 4))
            return x

    torch.fx.Tracer().trace(Submits())
    seq, = submitted
    for _ in engine.run([seq]):
        pass
    assert seq.tokens == lm.generate(torch.tensor([3, 17, 42]), max_new_tokens=4, ignore_eos=True).tolist()


@pytest.mark.parametrize("family", KINDS)
def test_a_growing_timeline_equals_single_runs(family, monkeypatch):
    """grow=True: the rows' timeline starts short and doubles while rows decode and others join
    (keys/values copied into the longer cache, rings kept); every row equals its single run, and
    the emptied engine goes back to the short timeline."""
    from kvwire.generate import engine as engine_module

    monkeypatch.setattr(engine_module, "GROW_FROM", 8)
    lm = tiny(family)
    rows = prompts(5, seed=5, low=4, high=12)
    budgets = [20, 3, 30, 6, 9]
    store = PrefixStore(min_tokens=4)
    engine = Engine(lm, max_batch=3, max_length=64, prefill_chunk=4, grow=True, prefix_store=store)
    assert engine.length == 8
    first = engine.submit(rows[0], budgets[0])
    drive(engine, [first], steps=3)
    assert engine.length == 32  # the first prompt + its budget
    later = [engine.submit(r, n) for r, n in zip(rows[1:3], budgets[1:3])]
    drive(engine, [first], steps=2)
    waiting = [engine.submit(r, n) for r, n in zip(rows[3:], budgets[3:])]
    seqs = [first, *later, *waiting]
    drive(engine, seqs)
    assert engine.stats["timeline_grown"] == 2 and engine.stats["per_row_steps"] > 5
    for seq, row, n in zip(seqs, rows, budgets):
        tokens, logprobs = single(lm, row, n)
        assert seq.tokens == tokens, (seq, row)
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
    engine.step()
    assert engine.idle and engine.length == 8 and engine.cache is None
    # a next turn restores its prefix into the short timeline, which grows for it
    turn2 = rows[2] + seqs[2].tokens + [5, 6, 7]
    again = engine.submit(turn2, 4)
    drive(engine, [again])
    assert again.cached_tokens > 0 and again.tokens == single(lm, turn2, 4)[0]


def test_a_growing_engine_never_passes_max_length(monkeypatch):
    from kvwire.generate import engine as engine_module

    monkeypatch.setattr(engine_module, "GROW_FROM", 16)
    lm = tiny("llama")
    engine = Engine(lm, max_batch=2, max_length=40, grow=True)
    seq = engine.submit(prompts(1, seed=6, low=10, high=11)[0], 29)
    slots = set()
    for _ in engine.run([seq]):
        slots |= {k.shape[2] for k, _ in engine.cache or ()}
    assert slots == {40} and engine.stats["timeline_grown"] == 1 and seq.finish_reason == "length"
    with pytest.raises(ValueError, match="max_length"):
        engine.submit([5] * 30, 11)


def test_decode_threads_change_the_pool_for_decode_steps_only():
    """Engine(decode_threads=1): decode steps run on one thread, prefill and the caller keep the
    pool's size; tokens are the same."""
    lm = tiny("llama")
    ids = prompts(2, seed=3)
    plain = Engine(lm, 2, 64)
    seqs = [plain.submit(p, 6, stop_ids=()) for p in ids]
    for _ in plain.run(seqs):
        pass
    before, seen = torch.get_num_threads(), []
    torch.set_num_threads(2)  # a pool of two (tests may run on one)
    try:
        one = Engine(lm, 2, 64, decode_threads=1)
        decode = one._decode
        one._decode = lambda: (seen.append(torch.get_num_threads()), decode())[1]
        again = [one.submit(p, 6, stop_ids=()) for p in ids]
        for _ in one.run(again):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert [s.tokens for s in again] == [s.tokens for s in seqs]
    assert seen and set(seen) == {1}
    with pytest.raises(kw.RequestError, match="decode_threads must be an int >= 1, got 0"):
        Engine(lm, 2, 64, decode_threads=0)
