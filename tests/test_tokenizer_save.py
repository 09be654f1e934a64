"""Tokenizer.save writes the form tokenizers parses fastest (string merges, vocabulary in key order);
the tokenizer read back is the same one."""
import json

import pytest
from tokenizers import Tokenizer as Backend, models

from kvwire.io.tokenizer import FAST_FORM_MARK, Tokenizer, write_backend
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


@pytest.mark.parametrize("vocab, merges", [
    ({"a": 0, " ": 1, "a ": 2, "b": 3, "a b": 4}, [("a", " "), ("a ", "b")]),
    # the string form skips a line starting with "#version" (a header in merges.txt files)
    ({"#version": 0, "1": 1, "#version1": 2, "a": 3, "b": 4, "ab": 5}, [("a", "b"), ("#version", "1")]),
])
def test_merges_the_string_form_cannot_hold_stay_pairs(tmp_path, vocab, merges):
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    write_backend(backend, tmp_path / "tokenizer.json")
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"] == [list(m) for m in merges]
    assert Backend.from_file(str(tmp_path / "tokenizer.json")).to_str() == backend.to_str()
    assert not list(tmp_path.glob("*.partial"))


def test_a_folder_that_cannot_be_rewritten_loads_as_it_is(tmp_path, monkeypatch):
    ours = Tokenizer(sentencepiece(), bos_token_id=None, eos_token_ids=[2])
    ours.save(tmp_path)
    ours.backend.save(str(tmp_path / "tokenizer.json"))  # as kvwire wrote it before
    (tmp_path / FAST_FORM_MARK).unlink()
    before = (tmp_path / "tokenizer.json").read_bytes()

    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("os.replace", full)
    loaded = Tokenizer.load(tmp_path)
    assert [loaded.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert (tmp_path / "tokenizer.json").read_bytes() == before and not (tmp_path / FAST_FORM_MARK).exists()
    assert not list(tmp_path.glob("*.partial"))


def test_a_folder_saved_with_pairs_is_rewritten_once(tmp_path):
    ours = Tokenizer(sentencepiece(), bos_token_id=None, eos_token_ids=[2])
    ours.save(tmp_path)
    assert (tmp_path / FAST_FORM_MARK).is_file()
    ours.backend.save(str(tmp_path / "tokenizer.json"))  # as kvwire wrote it before
    (tmp_path / FAST_FORM_MARK).unlink()
    assert isinstance(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"][0], list)
    loaded = Tokenizer.load(tmp_path)
    assert isinstance(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"][0], str)
    assert (tmp_path / FAST_FORM_MARK).is_file()
    assert [loaded.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert (tmp_path / "tokenizer.json").stat().st_mode & 0o777 == 0o644
    stamp = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    Tokenizer.load(tmp_path)
    assert (tmp_path / "tokenizer.json").stat().st_mtime_ns == stamp  # not rewritten again
