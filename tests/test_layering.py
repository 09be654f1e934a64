"""The rooms' order holds: `lint-imports` checks pyproject.toml's import-linter contracts (a lower
layer never imports a higher one; no circles inside a package), and the layers name every
top-level module of kvwire, so a new room cannot slip past them."""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _contracts():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_layers_name_every_top_level_module():
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in re.split(r"[|:]", layer)}
    package = ROOT / "kvwire"
    modules = {f"kvwire.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {f"kvwire.{p.name}" for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert modules - named == set(), f"top-level modules outside the layers contract: {sorted(modules - named)}"
    assert named - modules == set(), f"layers that name no module: {sorted(named - modules)}"


def test_lint_imports_keeps_every_contract():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install import-linter)")
    run = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{len(_contracts())} kept, 0 broken" in run.stdout
