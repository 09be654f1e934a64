"""Decoder layers that compute attention themselves over what transformers' Cache API returns
them (`kvwire.models.generic.timeline`): Bloom (ALiBi from the padding mask's running count), MPT
(ALiBi by key column), GPT-Neo (learned positions, a local band by key column) and Doge (whose
mask is computed from the values the cache returns). The columns
they see put the cache right-aligned before the chunk, so biases by column and by count hold for
every row wherever it stands in its cache. Their logits, cached greedy tokens, padded rows, edits
and control vectors against transformers are in tests/test_generic_families.py."""
import copy
from types import SimpleNamespace

import pytest
import torch

import kvwire as kw
from kvwire.models.generic import timeline

from .generic_configs import hf_logits, prompt, rollout, rows_joining_a_batch, tiny_model

transformers = pytest.importorskip("transformers")

# ALiBi by count; ALiBi by column; a local band by column; attention through the interface whose
# mask is computed from the cache's values (Doge's dynamic mask: tried through the interface first)
TYPES = ["bloom", "mpt", "gpt_neo", "doge"]
L = 40


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    original = tiny_model(request.param)
    hf = copy.deepcopy(original)  # kw.from_hf sets the original's attention implementation to kvwire's
    return SimpleNamespace(hf=hf, lm=kw.from_hf(original, generic=True))


def test_layers_attend_through_the_cache_api(model):
    parts = model.lm.backbone.layers
    assert all(part.calls and part.calls[0].through_cache for part in parts)
    assert model.lm.backbone.prelude.uses_timeline
    assert all(part.cache_spec(2, L, torch.float32)[0][2] == L for part in parts)  # full length, no ring


def test_rows_joining_a_batch_at_other_cache_indices_equal_each_alone(model):
    """The engine's rows stand at different cache indices (per-row cache_index) and are prefilled
    2 tokens a step: each row's tokens and log-probabilities equal its own run."""
    rows_joining_a_batch(model.lm, (6, 9, 4), (8, 5, 7), max_length=L, prefill_chunk=2, seed=5, head_start=4)


def test_columns_put_each_rows_cache_right_aligned_before_the_chunk():
    """Row 0 has written 3 indices (index 0 a pad), row 1 five, of 8; a 2-token chunk follows."""
    cache_index = torch.tensor([3, 5])
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 0] = 0
    index, held = timeline.aligned(cache_index, 8)
    assert held.tolist() == [[-5, -4, -3, -2, -1, 0, 1, 2], [-3, -2, -1, 0, 1, 2, 3, 4]]
    assert index.tolist() == [[3, 4, 5, 6, 7, 0, 1, 2], [5, 6, 7, 0, 1, 2, 3, 4]]
    columns = timeline.padding_mask(cache_index, 2, mask)
    assert columns.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]]
    # one index for the batch (exported graphs): the same columns for every row
    assert timeline.padding_mask(torch.tensor(3), 2, mask).tolist()[0] == columns.tolist()[0]


def test_the_cache_outside_a_cached_call_is_refused():
    cache = timeline.timeline_cache(2, 4)
    k = torch.zeros(1, 1, 1, 2)
    with pytest.raises(RuntimeError, match="outside its cached call"):
        cache.update(k, k, 0)


def test_an_alibi_model_exports_to_onnx_and_runs_transformers_tokens(tmp_path):
    """The timeline's columns, cache and masks trace into the exported step (one cache index for
    the batch) like the rest of the graph."""
    pytest.importorskip("onnxruntime")
    from kvwire.export import load_exported

    original = tiny_model("bloom", n_layer=2)  # two layers: an export's time grows with each
    hf = copy.deepcopy(original)
    kw.export(kw.from_hf(original, generic=True), tmp_path / "m.onnx", max_length=48)
    ids = prompt(1, 9, 6)
    got = load_exported(tmp_path / "m.onnx").generate(ids, max_new_tokens=12, ignore_eos=True)[0].tolist()
    assert got[-12:] == rollout(lambda x: hf_logits(hf, x), ids, 12)[0].tolist()


def test_sparse_attention_keeps_its_indexers_keys_beside_its_own():
    """DeepSeek V3.2's indexer picks 4 keys per query (the tiny config's index_topk) from every past
    token's indexer key, kept through the Cache API's `update_indexer`: each layer holds them in a
    slot beside its compressed keys, in the timeline's columns. Logits, cached greedy, left-padded
    rows and the engine's rows at per-row cache indices equal transformers'."""
    from .generic_configs import greedy_disagreements

    original = tiny_model("deepseek_v32")
    hf = copy.deepcopy(original)
    lm = kw.from_hf(original, generic=True)
    assert lm.backbone.rerun_reason is None
    assert all(list(part.cache_parts) == ["attention", "indexer"] for part in lm.backbone.layers)
    ids = prompt(2, 11, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    tokens = torch.stack(lm.generate(ids, max_new_tokens=8, ignore_eos=True))
    assert greedy_disagreements(lambda x: hf_logits(hf, x), ids, tokens) == []
    rows = [prompt(1, n, seed=n)[0] for n in (4, 9)]
    batch = lm.generate(rows, max_new_tokens=6, ignore_eos=True)
    for i, row in enumerate(rows):
        assert batch[i].tolist() == lm.generate(row, max_new_tokens=6, ignore_eos=True).tolist(), i
    rows_joining_a_batch(lm, (6, 9, 4), (8, 5, 7), max_length=L, prefill_chunk=2, seed=5, head_start=4)
