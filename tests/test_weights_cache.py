"""The cache of converted GGUF files keeps only entries a load can still find: making an entry removes
those whose file has changed or is gone, and leaves the entries of files still there, and folders
it did not make, alone."""
import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType

import kvwire as kw
from kvwire.info import info, lines
from kvwire.io import weights_cache
from kvwire.io.weights_cache import cache_root

from .gguf_families import write_gguf
from .tiny_models import tiny_hf

IDS = torch.tensor([[5, 17, 42, 9, 100, 3]])


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))


def _file(folder, name, seed=0, quant=GGMLQuantizationType.F32):
    folder.mkdir(exist_ok=True)
    write_gguf(folder / name, tiny_hf("llama", seed=seed, vocab_size=300), quant=quant)
    return folder / name


def _entries():
    return sorted(p.name for p in cache_root().iterdir() if (p / weights_cache.SOURCE).is_file())


def _logits(path):
    with torch.no_grad():
        return kw.load(path, progress=False)(IDS)


def test_a_rewritten_file_replaces_its_entry(tmp_path):
    path = _file(tmp_path / "models", "m.gguf")
    _logits(path)
    old = weights_cache.entry_for(path)
    assert _entries() == [old.name]
    st = path.stat()
    _file(tmp_path / "models", "m.gguf", seed=1)  # other weights at the same path
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    new_logits = _logits(path)
    assert _entries() == [weights_cache.entry_for(path).name] and not old.exists()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(path, fresh / "m.gguf")
    torch.testing.assert_close(new_logits, _logits(fresh / "m.gguf"), rtol=0, atol=0)  # the new file's model


def test_entries_of_deleted_copies_go_when_the_next_entry_is_made_and_others_stay(tmp_path, capsys):
    kept = _file(tmp_path / "kept", "a.gguf")
    copy = tmp_path / "copy" / "a.gguf"
    copy.parent.mkdir()
    shutil.copy(kept, copy)
    _logits(kept)
    _logits(copy)
    copy_entry = weights_cache.entry_for(copy)
    assert len(_entries()) == 2  # same bytes, two paths: two entries, each still found by its load
    copy.unlink()
    assert weights_cache.superseded() == [copy_entry]
    assert "2 converted models, 1 superseded" in "\n".join(lines(info()))  # `kvwire info` counts it
    (cache_root() / "steps").mkdir()  # a folder the weights cache did not make
    (cache_root() / "old-entry").mkdir()  # an entry from before entries recorded their file
    (cache_root() / "old-entry" / "weights.safetensors").write_bytes(b"x")
    capsys.readouterr()
    kw.load(_file(tmp_path / "other", "b.gguf", seed=2))  # a conversion prunes
    assert f"removed {copy_entry.name} from the cache" in capsys.readouterr().out
    assert sorted(_entries()) == sorted([weights_cache.entry_for(kept).name,
                                         weights_cache.entry_for(tmp_path / "other" / "b.gguf").name])
    assert (cache_root() / "steps").is_dir() and (cache_root() / "old-entry" / "weights.safetensors").is_file()
    assert weights_cache.superseded() == []
    _logits(kept)  # its entry still loads


def test_a_record_it_cannot_read_is_left_alone(tmp_path):
    folder = cache_root() / "odd"
    folder.mkdir(parents=True)
    (folder / weights_cache.SOURCE).write_text("not json")
    (cache_root() / "list").mkdir()
    (cache_root() / "list" / weights_cache.SOURCE).write_text("[1, 2]")
    assert weights_cache.superseded() == [] and weights_cache.prune() == []
    assert folder.is_dir() and (cache_root() / "list").is_dir()


@pytest.mark.parametrize("quantize", [None, "gguf"])
def test_a_file_that_fails_to_convert_leaves_no_entry(tmp_path, quantize):
    """A corrupt file is an error naming it, and the folder its conversion was to fill goes with
    it; the valid file's complete entry beside it stays and loads."""
    if quantize == "gguf":
        pytest.importorskip("llama_cpp")
    good = _file(tmp_path / "models", "good.gguf", quant=GGMLQuantizationType.Q8_0)
    kw.load(good, progress=False, quantize=quantize)
    data = bytearray(good.read_bytes())
    bad = tmp_path / "models" / "bad.gguf"
    bad.write_bytes(bytes(data[: len(data) * 3 // 4]))  # the last tensors cut off
    with pytest.raises(ValueError, match="bad.gguf"):
        kw.load(bad, progress=False, quantize=quantize)
    assert not weights_cache.entry_for(bad).exists()
    assert _entries() == [weights_cache.entry_for(good).name]
    assert kw.load(good, progress=False, quantize=quantize) is not None
