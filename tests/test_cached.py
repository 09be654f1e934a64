"""The generic runner, applied to every family: the cached graph equals the uncached forward."""
import pytest
import torch

import kvwire as kw
from kvwire.generate.session import left_pad

from .conftest import FAMILIES

# float32 summation order only (see tests/property_checks.py): Gemma's residual stream (|h| ~35 by
# its last block, no post-norms) carries the most, up to 3e-5 on its logits; a wrong key, position,
# mask or ring slot is >= 1e-2
ATOL = 1e-4


def run_chunks(lm, ids, chunks, max_length=None, mask=None, positions=None):
    """Feed ids (B, T) through the cached graph in chunks of the given sizes, on the model's device;
    logits (B, T, V)."""
    B, T = ids.shape
    assert sum(chunks) == T
    max_length = max_length or T
    cached, device = lm.cached, lm.device
    cache = cached.init_cache(B, max_length)
    mask = torch.ones(B, max_length, dtype=torch.bool, device=device) if mask is None else mask
    positions = torch.arange(T, device=device)[None].expand(B, T) if positions is None else positions
    out, start = [], 0
    with torch.no_grad():
        for n in chunks:
            h, cache = cached(ids[:, start:start + n], positions[:, start:start + n], start, mask, cache)
            out.append(lm.head(h))
            start += n
    return torch.cat(out, dim=1)


def random_ids(lm, B, T, seed):
    return torch.randint(0, lm.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(3))
def test_prefill_then_decode_equals_uncached(tiny_lm, seed):
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(2, 30, (1,), generator=g))
    prefill = int(torch.randint(1, T, (1,), generator=g))
    ids = random_ids(tiny_lm, 2, T, seed)
    with torch.no_grad():
        expected = tiny_lm(ids)
    got = run_chunks(tiny_lm, ids, [prefill] + [1] * (T - prefill), max_length=T + 3)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 9])
def test_chunked_prefill_equals_uncached(tiny_lm, chunk):
    """Chunks shorter and longer than the tiny sliding windows (4-6), over a sequence 4-6x the window."""
    ids = random_ids(tiny_lm, 1, 24, chunk)
    chunks = [chunk] * (24 // chunk) + ([24 % chunk] if 24 % chunk else [])
    with torch.no_grad():
        expected = tiny_lm(ids)
    torch.testing.assert_close(run_chunks(tiny_lm, ids, chunks), expected, atol=ATOL, rtol=0)


def test_long_chunks_after_decode_equal_uncached(tiny_lm):
    """Chunks of 70 (fused attention kernel) on top of a non-empty cache, then decode steps."""
    ids = random_ids(tiny_lm, 2, 120, 7)
    with torch.no_grad():
        expected = tiny_lm(ids)
    got = run_chunks(tiny_lm, ids, [5, 70, 1, 40, 1, 1, 1, 1])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_left_padded_batch_equals_single_rows(tiny_lm):
    rows = [random_ids(tiny_lm, 1, n, n)[0].tolist() for n in (3, 11, 7)]
    ids, positions, pads = left_pad(rows, pad_id=5)
    B, L = ids.shape
    extra = 4
    full = torch.cat([ids, random_ids(tiny_lm, B, extra, 99)], dim=1)  # decode a few shared tokens
    full_pos = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra)], dim=1)
    mask = torch.arange(L + extra)[None] >= pads[:, None]
    got = run_chunks(tiny_lm, full, [L] + [1] * extra, mask=mask, positions=full_pos)
    for i, row in enumerate(rows):
        alone = torch.cat([torch.tensor(row), full[i, L:]])[None]
        with torch.no_grad():
            expected = tiny_lm(alone)[0]
        torch.testing.assert_close(got[i, int(pads[i]):], expected, atol=ATOL, rtol=0)


def test_decode_writes_caches_in_place(tiny_lm):
    cached = tiny_lm.cached
    cache = cached.init_cache(1, 16)
    pointers = [t.data_ptr() for pair in cache for t in pair]
    mask = torch.ones(1, 16, dtype=torch.bool)
    with torch.no_grad():
        _, cache = cached(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], 0, mask, cache)
        _, cache = cached(torch.tensor([[4]]), torch.tensor([[3]]), 3, mask, cache)
    assert [t.data_ptr() for pair in cache for t in pair] == pointers
    assert any(pair[0].abs().sum() > 0 for pair in cache)


@pytest.mark.parametrize("family, slots", [
    ("gemma3", [3, 100, 3, 100]),  # window 4 on alternate layers
    ("gemma2", [3, 100, 3, 100]),
    ("qwen2", [100, 100, 3, 3]),  # window 4 from max_window_layers=2 on
    ("mistral", [4, 4, 4, 4]),  # window 5 on every layer
    ("phi3", [5, 5, 5, 5]),  # window 6 on every layer
    ("llama", [100, 100, 100, 100]),
])
def test_sliding_layers_get_a_ring_of_window_minus_one(family, slots):
    lm = kw.from_hf(FAMILIES[family]())
    assert [pair[0].shape[2] for pair in lm.cached.init_cache(2, 100)] == slots


def test_the_runner_covers_every_family():
    from kvwire.models import FAMILIES as KV_FAMILIES

    assert sorted(FAMILIES) == sorted(KV_FAMILIES), "tests/conftest.py FAMILIES needs every kvwire family"


def test_clone_identity_equals_original(tiny_lm):
    ids = random_ids(tiny_lm, 2, 9, 0)
    copy = tiny_lm.edit(None)
    with torch.no_grad():
        torch.testing.assert_close(copy(ids), tiny_lm(ids), atol=0, rtol=0)
    torch.testing.assert_close(run_chunks(copy, ids, [5, 1, 1, 1, 1]), run_chunks(tiny_lm, ids, [5, 1, 1, 1, 1]))
    assert copy.backbone is not tiny_lm.backbone
    shared = {p.data_ptr() for p in tiny_lm.parameters()}
    assert {p.data_ptr() for p in copy.parameters()} == shared


def _add_after_block(lm, index, vector):
    blocks = list(lm.backbone.h if hasattr(lm.backbone, "h") else lm.backbone.layers)

    def fn(layer, x):
        y = layer(x)
        return y + vector if layer is blocks[index] else y

    return lm.edit(fn)


def test_edit_survives_caching(tiny_lm):
    width = tiny_lm.head.weight.shape[1]
    vector = torch.randn(width, generator=torch.Generator().manual_seed(3)) * 2.0
    edited = _add_after_block(tiny_lm, 1, vector)
    prompt = random_ids(tiny_lm, 1, 6, 4)
    with torch.no_grad():
        assert (edited(prompt) - tiny_lm(prompt)).abs().max() > 1e-2
        rollout = prompt
        for _ in range(10):  # uncached argmax rollout of the edited model
            rollout = torch.cat([rollout, edited(rollout)[:, -1].argmax(-1, keepdim=True)], dim=1)
    tiny_lm.tokenizer = edited.tokenizer = None
    generated = edited.generate(prompt[0], max_new_tokens=10)
    eos = set(edited.config.eos_token_id if isinstance(edited.config.eos_token_id, list) else [edited.config.eos_token_id])
    expected = rollout[0, 6:].tolist()
    stop = next((i for i, t in enumerate(expected) if t in eos), len(expected))
    assert generated.tolist() == expected[:stop]
    assert len(generated) >= 3, "the rollout should not stop at once (else the test proves little)"


def test_inserted_module_is_registered_and_cached(tiny_lm):
    width = tiny_lm.head.weight.shape[1]
    scale = torch.nn.Linear(width, width)

    def fn(layer, x):
        return scale(layer(x)) if layer is tiny_lm.backbone.get_submodule(_final_norm(tiny_lm)) else layer(x)

    edited = tiny_lm.edit(fn)
    inserted = edited.backbone.meta["kvwire_inserted"]
    assert len(inserted) == 1 and inserted[0].endswith("__Linear")
    assert edited.backbone.get_submodule(inserted[0]) is scale
    ids = random_ids(tiny_lm, 1, 8, 5)
    with torch.no_grad():
        expected = edited(ids)
    torch.testing.assert_close(run_chunks(edited, ids, [3, 5]), expected, atol=ATOL, rtol=0)
    twice = kw.clone(edited.backbone)  # a clone can be cloned again
    with torch.no_grad():
        torch.testing.assert_close(twice(ids), edited.backbone(ids))


def _final_norm(lm):
    return "ln_f" if hasattr(lm.backbone, "ln_f") else "norm"


def test_layer_depth_clone_sees_attention(tiny_lm):
    seen = []
    kw.clone(tiny_lm.backbone, lambda layer, *a: seen.append(type(layer).__name__) or layer(*a), depth="layer")
    assert "Attention" in seen and not any(name.endswith("Block") for name in seen)
    blocks = []
    kw.clone(tiny_lm.backbone, lambda layer, *a: blocks.append(type(layer).__name__) or layer(*a))
    assert sum(name.endswith("Block") for name in blocks) == len(tiny_lm.cached.slots)
