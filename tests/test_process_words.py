"""The repository speaks of the project only: no file names the team's work periods, internal
ticket numbers or reviewers. Public references name their project: "coremltools #2008",
"keras-hub #1598", "pytorch/pytorch#176347". Technical words stay: `generate/session.py`,
onnxruntime's `InferenceSession`, a random seed."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = {".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".c", ".cpp", ".h", ".js", ".html", ".css", ".cfg", ".json",
        ".jinja", ""}
PROCESS = re.compile(
    r"\bsessions? \d+"  # a numbered work period
    r"|\b(?:issue|ticket)s? #?\d+"  # an internal ticket (public ones read "project #N")
    r"|\bhelper-\d+"  # a numbered reviewer
    r"|\bthe seed's\b",  # the documents the project started from
    re.I)


def process_words(text):
    return PROCESS.findall(text)


def test_the_pattern_finds_process_words_and_spares_technical_ones():
    # split, so that this file does not hold the phrases it looks for
    flagged = ["measured in sess" + "ion 23", "see iss" + "ue 16", "as help" + "er-14 found", "the se" + "ed's example"]
    spared = ["kvwire/generate/session.py", "onnxruntime's InferenceSession", "a random seed", "seed + i",
              "coremltools #2008", "keras-hub #1598", "pytorch/pytorch#176347", "the seed of row i", "the seed gives the same tokens",
              "session.prefill()"]
    assert all(process_words(t) for t in flagged), [t for t in flagged if not process_words(t)]
    assert not any(process_words(t) for t in spared), [t for t in spared if process_words(t)]


def test_no_tracked_file_speaks_of_the_work_process():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = {}
    for name in files.stdout.split("\0"):
        path = ROOT / name
        if not name or Path(name).suffix not in TEXT or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        words = process_words(text)
        if words:
            found[name] = sorted(set(words))
    assert not found, f"process words in the repository: {found}"
