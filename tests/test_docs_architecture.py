"""docs/architecture.md's table of rooms stays the tree's map: its `kvwire/serve/` row names every
module and folder of the server, and only ones that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "kvwire" / "serve"


def named_in_row(folder):
    """The `file.py` and `folder/` names in the table row of `folder` (e.g. "kvwire/serve/")."""
    rows = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
            if line.startswith(f"| `{folder}` |")]
    assert len(rows) == 1, f"docs/architecture.md has {len(rows)} rows for {folder}; expected 1"
    return {name for name in re.findall(r"`([\w./-]+)`", rows[0].split("|")[2]) if name.endswith((".py", "/"))}


def test_the_serve_row_names_every_server_module_and_folder():
    modules = {p.name for p in SERVE.glob("*.py") if p.name != "__init__.py"}
    folders = {p.name + "/" for p in SERVE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert {"inline_wire.py", "inline_sae.py", "tools/"} <= modules | folders  # the listing itself works
    named = named_in_row("kvwire/serve/")
    assert not (modules | folders) - named, f"the serve row leaves out {sorted((modules | folders) - named)}"
    assert not named - (modules | folders), f"the serve row names absent files: {sorted(named - modules - folders)}"
