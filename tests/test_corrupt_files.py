"""Corrupt and hostile files never crash. Every case of corrupt_cases.py and corrupt_configs.py
(GGUF files truncated, flipped and rewritten; safetensors, index, config.json and tokenizer files
broken) is loaded with `kw.load`, and with quantize="gguf" where a GGUF loads, in child
processes: each must end in a clear ValueError naming the file, or load the valid file's model (a
different one only where the corruption cannot be told from a real file). A signal, a hang, any
other exception, or a model that differs silently fails the test, which names the case."""
import importlib.util
import json
import os
import re
import selectors
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from .conftest import HEAVY, tiny_hf_gemma3, tiny_hf_gpt2
from .corrupt_cases import Cases, gguf_cases
from .corrupt_configs import gguf_metadata_cases, hf_cases
from .gguf_files import write_gemma3, write_gpt2

ROOT = Path(__file__).resolve().parent.parent
CASE_TIMEOUT, STARTUP_TIMEOUT = 20, 120  # seconds a case, and an import of torch on a busy machine


def _ggml_bridge():
    """The folder of the ggml bridge this machine has built (building takes ~15 s), or None
    without ggml: then no case runs quantize="gguf"."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from kvwire.kernels.ggml.lib import GGMLUnavailable, library

    try:
        return Path(library()._name).parent.parent
    except GGMLUnavailable:
        return None


def _make_cases(tmp_path, with_ggml, every=HEAVY):
    """The cases: GGUF files of both architectures and HF folders of both families with `every`
    (KVWIRE_HEAVY_TESTS=1: 3303 cases, ~45 s of one core); else (the default suite: 1851 cases,
    ~25 s) GGUF files of Gemma 3 and HF folders of GPT-2, the same corruptions on each kind of file."""
    cases = Cases(tmp_path / "cases")
    valid = tmp_path / "valid"
    valid.mkdir()
    write_gemma3(valid / "gemma3.gguf", tiny_hf_gemma3(vocab_size=300), Q.Q8_0)
    write_gpt2(valid / "gpt2.gguf", tiny_hf_gpt2(vocab_size=300), Q.Q8_0)
    for arch in ("gemma3", "gpt2") if every else ("gemma3",):
        gguf_cases(cases, arch, valid / f"{arch}.gguf")
        gguf_metadata_cases(cases, arch, valid / f"{arch}.gguf")
    families = (("gpt2", tiny_hf_gpt2), ("gemma3", tiny_hf_gemma3))
    for family, make in families if every else families[:1]:
        folder = valid / family
        make().save_pretrained(folder)
        if family == "gpt2":
            _tokenizer_json(folder)
        hf_cases(cases, family, folder)
    if not with_ggml:
        for case in cases.items:
            case["gguf"] = False
    return cases.items


def _tokenizer_json(folder):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["the cat sat on the mat"] * 5, vocab_size=96, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save(str(folder / "tokenizer.json"))


def _child_env(tmp_path, bridge):
    """A private weights cache (no case can meet another file's entry) sharing the ggml bridge."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if bridge is not None:
        (cache / "ggml").symlink_to(bridge, target_is_directory=True)
    return {**os.environ, "KVWIRE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}


def _batch(spec, stderr, env):
    """Run the cases listed in `spec` in one child: {case id: result}. A case the child dies or
    hangs on gets outcome "died" / "timeout"; the cases after it are left for the next child."""
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.corrupt_child", str(spec)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=err)
    results, started, buf, hung = {}, None, b"", False
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while True:
        if not selector.select(timeout=CASE_TIMEOUT if started or results else STARTUP_TIMEOUT):
            hung = True
            proc.kill()
            break
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        if not chunk:
            break
        *lines, buf = (buf + chunk).split(b"\n")
        for line in (x for x in lines if x.startswith(b"@@ ")):
            message = json.loads(line[3:])
            started = message["id"] if message["event"] == "start" else None
            if message["event"] == "done":
                results[message["id"]] = message
    proc.wait()
    proc.stdout.close()
    if started is not None:
        results[started] = {"outcome": "timeout" if hung else "died", "returncode": proc.returncode}
    return results


def _run(cases, tmp_path, bridge):
    """{case id: result} for every case, and how many children that took."""
    env, results, pending = _child_env(tmp_path, bridge), {}, list(cases)
    children = 0
    while pending:
        children += 1
        spec, stderr = tmp_path / f"batch-{children}.json", tmp_path / f"stderr-{children}.txt"
        spec.write_text(json.dumps(pending))
        results.update(_batch(spec, stderr, env))
        left = [c for c in pending if c["id"] not in results]
        assert len(left) < len(pending), f"a child ran no case:\n{stderr.read_text()[-3000:]}"
        pending = left
    return results, children


def _judge(case, got, reference):
    """What is wrong with one outcome (None: nothing)."""
    if got["outcome"] in ("died", "timeout"):
        return f"{got['outcome']} (return code {got['returncode']})"
    if got["outcome"] == "error":
        if not got["value_error"]:
            return f"raised {got['type']}: {got['message']}"
        if Path(case["path"]).name not in got["message"]:
            return f"the message does not name the file: {got['message']}"
        if case["match"] and not re.search(case["match"], got["message"]):
            return f"the message does not match {case['match']!r}: {got['message']}"
        return "failed to load a valid file: " + got["message"] if case["expect"] == "same" else None
    if case["expect"] == "error":
        return "loaded (expected a clear error)"
    same = reference is not None and reference["outcome"] == "loaded" and \
        (got["digest"], got["tokens"]) == (reference["digest"], reference["tokens"])
    return None if same or case["may_differ"] else "loaded a different model than the valid file (silently wrong)"


def test_corrupt_files_end_in_clear_errors(tmp_path):
    bridge = _ggml_bridge()
    cases = _make_cases(tmp_path, with_ggml=bridge is not None)
    results, children = _run(cases, tmp_path, bridge)
    problems, outcomes = [], Counter()
    for case in cases:
        got = results[case["id"]]
        reference = results.get(case["control"], got) if case["control"] else got
        outcomes[got["outcome"]] += 1
        runs = [("", got, reference)]
        if "gguf" in got:
            outcomes["gguf " + got["gguf"]["outcome"]] += 1
            runs.append((" with quantize='gguf'", got["gguf"], reference.get("gguf")))
        for how, result, ref in runs:
            problem = _judge(case, result, ref)
            if problem:
                problems.append(f"{case['id']} ({case['what']}){how}: {problem}")
    print(f"\n{len(cases)} corrupt-file cases in {children} child process(es): {dict(outcomes)}")
    assert not problems, f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems[:40])
    assert bridge is None or outcomes["gguf loaded"] > 0  # ggml's kernels did run on the files' blocks


def test_a_child_that_dies_is_reported_and_the_rest_still_run(tmp_path):
    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300))
    case = dict(path=str(tmp_path / "g.gguf"), gguf=False)
    cases = [dict(case, id="before"), dict(case, id="crash", signal=signal.SIGSEGV), dict(case, id="after")]
    results, children = _run(cases, tmp_path, None)
    assert children == 2
    assert results["crash"] == {"outcome": "died", "returncode": -signal.SIGSEGV}
    assert results["before"]["outcome"] == results["after"]["outcome"] == "loaded"
