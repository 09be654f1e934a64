"""Edit helpers (select / insert / replace / skip) and taps on tiny models of every family."""
import pytest
import torch
from torch import nn

import kvwire as kw
from kvwire.layers.base import Block, Layer

from .conftest import FAMILIES


class Shift(Layer):
    def __init__(self, v):
        super().__init__()
        self.register_buffer("v", v)

    def forward(self, x):
        return x + self.v


def _ids(seed=0, shape=(2, 9)):
    return torch.randint(3, 96, shape, generator=torch.Generator().manual_seed(seed))


def test_select_by_pattern_range_type_and_function(tiny_lm):
    bb = tiny_lm.backbone
    blocks = kw.block_calls(bb)
    stem = blocks[0].rsplit(".", 1)[0]
    assert blocks == [f"{stem}.{i}" for i in range(len(blocks))]
    assert kw.select(bb, f"{stem}.1-2") == blocks[1:3]
    assert kw.select(bb, f"{stem}.*") == blocks
    assert kw.select(bb, Block) == blocks
    assert kw.select(bb, lambda name, layer: name.endswith(".0")) == blocks[:1]
    assert kw.select(bb, [f"{stem}.2", f"{stem}.0"]) == [blocks[0], blocks[2]]
    attn = kw.select(bb, f"{stem}.0.*attn", depth="layer")
    assert len(attn) == 1 and attn[0].startswith(f"{stem}.0.")


@pytest.mark.parametrize("where, message", [
    ("{stem}.1-40", "index 40 is out of range; {stem} has indices 0-"),
    ("{stem}.3-1", "range 3-1 is empty"),
    ("nothing.*", "matches no layer call; the calls are: "),
    (3.5, "a selector is a name pattern"),
])
def test_bad_selectors_are_clear_errors(tiny_lm, where, message):
    stem = kw.block_calls(tiny_lm.backbone)[0].rsplit(".", 1)[0]
    where = where.format(stem=stem) if isinstance(where, str) else where
    with pytest.raises((ValueError, TypeError), match=message.format(stem=stem).replace("(", r"\(")):
        kw.select(tiny_lm.backbone, where)


def test_insert_after_equals_a_hand_written_clone_and_survives_the_cache(tiny_lm):
    v = torch.randn(tiny_lm.head.weight.shape[1]) * 0.5
    blocks = kw.block_calls(tiny_lm.backbone)
    picked = blocks[1:]
    by_helper = tiny_lm.edit(kw.insert_after(picked, Shift(v)))
    targets = {tiny_lm.backbone.get_submodule(n) for n in picked}
    by_hand = tiny_lm.edit(lambda layer, x: layer(x) + v if layer in targets else layer(x))
    ids = _ids()
    torch.testing.assert_close(by_helper(ids), by_hand(ids), rtol=0, atol=0)
    assert not torch.allclose(by_helper(ids), tiny_lm(ids))
    # cached greedy == uncached argmax rollout of the edited model
    prompt = ids[0, :5]
    got = by_helper.generate(prompt, max_new_tokens=6, ignore_eos=True)
    seq = prompt.clone()
    for _ in range(6):
        seq = torch.cat([seq, by_helper(seq[None])[0, -1].argmax()[None]])
    assert got.tolist() == seq[5:].tolist()


def test_insert_before_replace_and_skip(tiny_lm):
    bb = tiny_lm.backbone
    blocks = kw.block_calls(bb)
    ids = _ids(1)
    h = kw.tap(bb, blocks[0])(ids)[1][blocks[0]]
    # skipping every block but the first leaves embeddings -> block 0 -> final norm
    skipped = kw.clone(bb, kw.skip(blocks[1:]))
    norm = bb.get_submodule(kw.select(bb, lambda n, l: True)[-1])
    torch.testing.assert_close(skipped(ids), norm(h))
    # replacing the last block with identity equals skipping it
    replaced = kw.clone(bb, kw.replace(blocks[-1], nn.Identity()))
    torch.testing.assert_close(replaced(ids), kw.clone(bb, kw.skip(blocks[-1]))(ids), rtol=0, atol=0)
    # inserting before block k equals inserting after block k-1
    v = torch.randn(h.shape[-1])
    before = kw.clone(bb, kw.insert_before(blocks[2], Shift(v)))
    after = kw.clone(bb, kw.insert_after(blocks[1], Shift(v)))
    torch.testing.assert_close(before(ids), after(ids), rtol=0, atol=0)


def test_make_function_gets_each_name_and_modules_are_registered(tiny_lm):
    seen = []
    blocks = kw.block_calls(tiny_lm.backbone)

    def make(name, layer):
        seen.append((name, layer))
        return Shift(torch.zeros(tiny_lm.head.weight.shape[1]))

    edited = kw.clone(tiny_lm.backbone, kw.insert_after(blocks, make))
    assert [n for n, _ in seen] == blocks
    assert all(layer is tiny_lm.backbone.get_submodule(n) for n, layer in seen)
    inserted = edited.meta["kvwire_inserted"]
    assert len(inserted) == len(blocks) and all("__Shift" in n for n in inserted)


def test_edit_objects_refuse_direct_calls():
    with pytest.raises(RuntimeError, match="is a clone fn"):
        kw.skip("layers.0")(nn.Identity(), torch.zeros(1))


def test_tap_returns_block_outputs_in_one_forward(tiny_lm):
    bb = tiny_lm.backbone
    blocks = kw.block_calls(bb)
    tapped = kw.tap(bb, blocks[1:3])
    ids = _ids(2)
    hidden, taps = tapped(ids)
    torch.testing.assert_close(hidden, bb(ids), rtol=0, atol=0)
    assert list(taps) == blocks[1:3]
    # block 1's output, recomputed by running the graph with everything after it skipped
    upto = kw.clone(bb, kw.skip(blocks[2:]))
    norm = bb.get_submodule(kw.select(bb, lambda n, l: True)[-1])
    torch.testing.assert_close(norm(taps[blocks[1]]), upto(ids))


def test_cached_tap_with_left_padding_equals_single_rows(family):
    from kvwire.steer.vector import last_token_states
    from .tokenizers_for_tests import char_level

    lm = kw.from_hf(FAMILIES[family](vocab_size=100))
    lm.tokenizer = char_level()
    names = kw.block_calls(lm.backbone)[1:]
    texts = ["a short one", "a much longer prompt than that", "mid length"]
    batched = last_token_states(lm, texts, names, batch_size=3, progress=False)
    for i, text in enumerate(texts):
        ids = torch.tensor([lm.tokenizer.encode(text)])
        with torch.inference_mode():  # as last_token_states runs: the same kernels (fused ones skip autograd)
            _, taps = kw.tap(lm.backbone, names)(ids)
        for name in names:
            # float32 rounding of a batch of 3 rows and of one row differs (products' summation order
            # depends on the row count): a few 1e-7 of the largest state per layer, not of each value
            scale = float(batched[name].abs().max())
            torch.testing.assert_close(batched[name][i], taps[name][0, -1], atol=2e-6 * scale, rtol=1e-5)
