"""The manual's own links: every local file the README and the docs pages point to (pictures,
pages, scripts, data) is in the repository, so no checkout and no built site shows a broken link,
and every file they name in code exists."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# <img src="..."> and [text](target) / ![alt](target); http(s), mailto and in-page anchors are not files
LINK = re.compile(r'src="([^"]+)"|\]\(([^)\s]+)\)')
NAMED = re.compile(r"`((?:bench|examples|tests|kvwire|docs)/[\w./-]+\.(?:py|gguf|txt|svg|png|md|c|cpp))`")
RUN = re.compile(r"python ((?:bench|examples)/[\w./-]+\.py)")


def manual_pages():
    """README.md and every Markdown page of the docs site (repository-relative paths)."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [p.relative_to(ROOT).as_posix() for p in pages if p.is_file()]


def local_targets(text):
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).split("#")[0]
        if target and not re.match(r"^[a-z]+:", target):
            yield target


def tracked_files():
    return set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split())


def resolve(page, target):
    """`target` as a repository-relative path, resolved from the folder of `page`."""
    joined = (ROOT / page).parent / target
    return Path(*joined.resolve().relative_to(ROOT.resolve()).parts).as_posix()


def test_the_link_pattern_finds_pictures_pages_and_anchors():
    text = '<img src="docs/a.svg" height="5"> [x](docs/b.md#part) ![y](c.png){ height=520 } [z](https://e.org/d)'
    assert list(local_targets(text)) == ["docs/a.svg", "docs/b.md", "c.png"]
    assert resolve("docs/steering.md", "sweep.png") == "docs/sweep.png"
    assert resolve("docs/api/graph.md", "../editing.md") == "docs/editing.md"


@pytest.mark.parametrize("page", manual_pages())
def test_every_local_link_is_tracked_by_git(page):
    targets = sorted({resolve(page, t) for t in local_targets((ROOT / page).read_text())})
    tracked = tracked_files()
    missing = [t for t in targets if t not in tracked and not any(f.startswith(t.rstrip("/") + "/") for f in tracked)]
    assert not missing, f"{page} links to files that are not in the repository: {missing}"


def test_the_readme_links_its_picture_and_the_docs():
    targets = set(local_targets((ROOT / "README.md").read_text()))
    assert "docs/cached_steered_tiny.svg" in targets  # the picture of the edited graph with its cache wiring
    for page in ("docs/getting-started.md", "docs/performance.md", "docs/testing.md", "docs/architecture.md"):
        assert page in targets, f"README does not link {page}"


@pytest.mark.parametrize("page", [p for p in manual_pages() if p != "CHANGELOG.md"])  # history names old files
def test_the_files_a_page_names_in_code_exist(page):
    text = (ROOT / page).read_text()
    named = set(NAMED.findall(text)) | set(RUN.findall(text))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"{page} names files that do not exist: {missing}"


def test_the_readme_names_files_at_all():
    text = (ROOT / "README.md").read_text()
    assert set(NAMED.findall(text)) | set(RUN.findall(text)), "no file names found: the pattern is wrong"
