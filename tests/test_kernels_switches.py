"""The kernels room: one table of `KVWIRE_*` switches, read through one function, documented in
docs/kernels.md and shown by `kvwire info`; kernels/ imports nothing above it; quantised modules
say what they need as attributes instead of being imported by name."""
import ast
import re
from pathlib import Path

import pytest
from torch import nn

from kvwire import cli
from kvwire.kernels import switches

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvwire"


def _sources():
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".cpp") and p.is_file())


def test_every_kvwire_variable_in_the_code_is_in_the_table():
    found = {name for p in _sources() for name in re.findall(r"KVWIRE_[A-Z0-9_]+", p.read_text())}
    assert found, "the scan found no switch at all"
    assert found <= set(switches.TABLE), sorted(found - set(switches.TABLE))


def test_every_switch_is_documented_with_its_values():
    doc = (ROOT / "docs" / "kernels.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in doc.splitlines() if line.startswith("| `KVWIRE_")}
    assert set(rows) == set(switches.TABLE)
    for name, switch in switches.TABLE.items():
        assert all(f"`{choice}`" in rows[name] for choice in switch.choices or ()), rows[name]


def test_only_the_table_reads_the_environment_for_switches():
    reads = re.compile(r"(os\.environ(\.get)?\s*[\[(]|os\.getenv\s*\()\s*[\"'](KVWIRE_[A-Z0-9_]+)")
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        names = {m.group(3) for m in reads.finditer(path.read_text())}
        if rel == "kvwire/kernels/switches.py":
            continue
        assert not names, f"{rel} reads {sorted(names)} itself"


def test_a_switch_is_validated_naming_the_variable_the_value_and_the_choices(monkeypatch):
    monkeypatch.delenv("KVWIRE_FUSED", raising=False)
    assert switches.get("KVWIRE_FUSED") is None
    monkeypatch.setenv("KVWIRE_FUSED", " ATen ")
    assert switches.get("KVWIRE_FUSED") == "aten"
    monkeypatch.setenv("KVWIRE_FUSED", "fast")
    with pytest.raises(ValueError, match=r"^KVWIRE_FUSED='fast'; expected one of kvwire, aten$"):
        switches.get("KVWIRE_FUSED")
    with pytest.raises(ValueError, match="KVWIRE_FAST is not one of kvwire's switches"):
        switches.get("KVWIRE_FAST")
    monkeypatch.setenv("KVWIRE_CACHE", "/some/Folder")  # free-form: as set
    assert switches.get("KVWIRE_CACHE") == "/some/Folder"
    assert switches.cache_root() == Path("/some/Folder")


def test_info_shows_every_switch_with_its_value_and_default(monkeypatch, capsys):
    for name in switches.TABLE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVWIRE_CACHE", "/tmp/kvwire-cache-shown")
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    for name, switch in switches.TABLE.items():
        line = next(line for line in text.splitlines() if line.strip().startswith(name))
        assert f"default: {switch.default}" in line
        assert ("'/tmp/kvwire-cache-shown'" if name == "KVWIRE_CACHE" else "unset") in line


def _imports(path):
    """The absolute kvwire module names `path` imports (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvwire")}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("kvwire"):
                found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


ABOVE_KERNELS = ("layers", "graph", "models", "quant", "generate", "load", "steer", "export", "serve", "info", "cli")


def test_kernels_import_nothing_above_them():
    files = list((PACKAGE / "kernels").rglob("*.py"))
    assert len(files) > 5
    for path in files:
        above = {m for m in _imports(path) if m.split(".")[1:2] and m.split(".")[1] in ABOVE_KERNELS}
        assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


@pytest.mark.parametrize("importer, forbidden", [
    ("kvwire/quant/ggml/apply.py", "kvwire.quant.apply"),  # quant.apply imports the ggml side, never back
    ("kvwire/export/api.py", "kvwire.quant"),
    ("kvwire/generate/compiled.py", "kvwire.quant"),
])
def test_arrows_that_go_one_way(importer, forbidden):
    imported = _imports(ROOT / importer)
    assert imported  # the scan sees its imports at all
    assert not {m for m in imported if m == forbidden or m.startswith(forbidden + ".")}


def test_quantised_modules_declare_their_cpu_only_kernels():
    from kvwire.layers.linear import Linear
    from kvwire.quant.ggml import GGMLLinear
    from kvwire.quant.linear import QuantizedLinear

    assert QuantizedLinear.cpu_only == "int8/int4 (PyTorch's CPU kernels)"
    assert GGMLLinear.cpu_only == "ggml blocks (ggml's CPU kernels)"
    assert QuantizedLinear.exportable is False and GGMLLinear.exportable is False
    for ordinary in (nn.Linear, Linear):
        assert getattr(ordinary, "cpu_only", None) is None and getattr(ordinary, "exportable", True)


def test_threads_switch_and_option_size_torchs_pool(monkeypatch, capsys, tmp_path):
    """--threads (or KVWIRE_THREADS) sets torch's CPU pool before the command runs; bad values are
    refused naming what was received."""
    import torch

    from kvwire import cli
    from kvwire.kernels import threads

    monkeypatch.setattr(threads, "_pinned", None)  # the commands pin it; given back after the test
    before = torch.get_num_threads()
    want = 2 if before != 2 else 3
    try:
        # a command that fails after the pool is sized: a model file that does not exist
        missing = str(tmp_path / "missing.gguf")
        assert cli.main(["score", str(tmp_path / "t.txt"), "--model", missing, "--threads", str(want)]) == 2
        assert torch.get_num_threads() == want and threads.pinned() == want  # kept under load too
        monkeypatch.setenv("KVWIRE_THREADS", "1")
        assert cli.main(["score", str(tmp_path / "t.txt"), "--model", missing]) == 2
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("KVWIRE_THREADS", "many")
        assert cli.main(["score", str(tmp_path / "t.txt"), "--model", missing]) == 2
        assert "KVWIRE_THREADS='many'; expected a positive int" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--threads", "0"])
    assert "expected a positive int, got '0'" in capsys.readouterr().err
