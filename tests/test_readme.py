"""The README's own links: every local file it points to (pictures, scripts, data) is in the
repository, so no checkout shows a broken picture."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# <img src="..."> and [text](target); http(s) and in-page anchors are not files
LINK = re.compile(r'src="([^"]+)"|\]\(([^)\s]+)\)')


def _local_targets(text):
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).split("#")[0]
        if target and not re.match(r"^[a-z]+:", target):
            yield target


def test_every_local_link_of_the_readme_is_tracked_by_git():
    text = (ROOT / "README.md").read_text()
    targets = sorted(set(_local_targets(text)))
    assert "docs/gemma3_steered.svg" in targets  # the pattern finds the pictures at all
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    missing = [t for t in targets if t not in tracked and not any(f.startswith(t.rstrip("/") + "/") for f in tracked)]
    assert not missing, f"README links to files that are not in the repository: {missing}"


def test_the_files_the_readme_names_in_code_exist():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`((?:bench|examples|tests|kvwire|docs)/[\w./-]+\.(?:py|gguf|txt|svg|c|cpp))`", text))
    named |= set(re.findall(r"python ((?:bench|examples)/[\w./-]+\.py)", text))
    assert named, "no file names found: the pattern is wrong"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"README names files that do not exist: {missing}"
