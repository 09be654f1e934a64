"""Tokenizer.save writes the form tokenizers parses fastest (string merges, vocabulary in key order);
the tokenizer read back is the same one."""
import json

import pytest
from tokenizers import Tokenizer as Backend, models

from kvwire.io.tokenizer import COMPACT_MARK, Tokenizer, write_backend
from kvwire.io.tokenizer_gguf import add_special_tokens, byte_level_bpe, sentencepiece_bpe
from .tokenizers_for_tests import CORPUS, byte_level

TEXTS = CORPUS[:4] + ["  two  spaces\tand a tab", "<start_of_turn>user\nhi<end_of_turn>", "\u00e9\u00e8 \u6771\u4eac"]


def sentencepiece():
    tokens = ["<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581", "\u2581\u2581", *"abcdefhilnorstuy",
              "th", "the", "\u2581the", "at", "cat", "\u2581cat", "er", "\u2581a", "an", "and"]
    backend = sentencepiece_bpe(tokens)
    add_special_tokens(backend, tokens, [2, 3, 3] + [1] * (len(tokens) - 3), [], byte_level=False)
    return backend


@pytest.mark.parametrize("make", [sentencepiece, lambda: byte_level().backend,
                                  lambda: byte_level_bpe(["\u0120", "t", "\u0120t"], ["\u0120 t"], "smollm")])
def test_saved_merges_are_strings_and_load_to_the_same_tokenizer(tmp_path, make):
    backend = make()
    write_backend(backend, tmp_path / "tokenizer.json")
    model = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    merges, keys = model["merges"], list(model["vocab"])
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    assert keys == sorted(keys) != list(json.loads(backend.to_str())["model"]["vocab"])  # not in id order
    again = Backend.from_file(str(tmp_path / "tokenizer.json"))
    assert again.to_str() == backend.to_str()  # tokenizers writes the pairs back: every field equal
    for text in TEXTS:
        assert again.encode(text).ids == backend.encode(text).ids


def test_merges_with_a_space_stay_pairs(tmp_path):
    vocab = {"a": 0, " ": 1, "a ": 2, "b": 3, "a b": 4}
    backend = Backend(models.BPE(vocab=vocab, merges=[("a", " "), ("a ", "b")]))
    write_backend(backend, tmp_path / "tokenizer.json")
    merges = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]
    assert merges == [["a", " "], ["a ", "b"]]
    assert Backend.from_file(str(tmp_path / "tokenizer.json")).encode("a b").ids == [4]
    assert not list(tmp_path.glob("*.partial"))


def test_a_folder_saved_with_pairs_is_rewritten_once(tmp_path):
    ours = Tokenizer(sentencepiece(), bos_token_id=None, eos_token_ids=[2])
    ours.save(tmp_path)
    assert (tmp_path / COMPACT_MARK).is_file()
    ours.backend.save(str(tmp_path / "tokenizer.json"))  # as kvwire wrote it before
    (tmp_path / COMPACT_MARK).unlink()
    assert isinstance(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"][0], list)
    loaded = Tokenizer.load(tmp_path)
    assert isinstance(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"][0], str)
    assert (tmp_path / COMPACT_MARK).is_file()
    assert [loaded.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    stamp = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    Tokenizer.load(tmp_path)
    assert (tmp_path / "tokenizer.json").stat().st_mtime_ns == stamp  # not rewritten again
