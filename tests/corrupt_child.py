"""The child process of test_corrupt_files: loads each case of a JSON list and reports on stdout.

Run as `python -m tests.corrupt_child cases.json`. For every case it prints a "start" line, then a
"done" line with the outcome: "error" (the exception's type, whether it is a ValueError, its
message) or "loaded" (a digest of the logits on fixed ids and the tokens of fixed texts). A load
that succeeds is repeated with quantize="gguf" when the case asks, so ggml's kernels run on the
file's blocks. Lines start with "@@ " so anything else a library prints is ignored. Memory is
capped, so a huge allocation is a MemoryError (a failure) rather than trouble for the machine.
"""
import hashlib
import json
import os
import resource
import sys

MEMORY = 4 << 30
IDS = [[5, 17, 42, 9, 55, 23, 8, 90]]  # below every tiny vocabulary
TEXTS = ["the cat sat", "<bos> <eos> caf\u00e9 \u4f60\u597d"]


def emit(message):
    sys.stdout.write("@@ " + json.dumps(message) + "\n")
    sys.stdout.flush()


def outcome(load):
    import torch

    try:
        lm = load()
        with torch.no_grad():
            logits = lm(torch.tensor(IDS))
    except Exception as e:  # the parent judges which exceptions are clear
        return {"outcome": "error", "type": type(e).__name__, "value_error": isinstance(e, ValueError),
                "message": str(e)[:600]}
    digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16]
    tokens = [lm.tokenizer.encode(t) for t in TEXTS] if lm.tokenizer is not None else None
    return {"outcome": "loaded", "digest": digest, "tokens": tokens}


def main(cases_path):
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    import torch

    import kvwire as kw

    torch.set_num_threads(1)  # bitwise-reproducible logits: digests compare across processes
    for case in json.loads(open(cases_path).read()):
        emit({"event": "start", "id": case["id"]})
        if case.get("signal"):  # the harness's own test: a child that dies mid-case
            os.kill(os.getpid(), case["signal"])
        result = {"event": "done", "id": case["id"], **outcome(lambda: kw.load(case["path"], progress=False))}
        if case["gguf"] and result["outcome"] == "loaded":
            result["gguf"] = outcome(lambda: kw.load(case["path"], progress=False, quantize="gguf"))
        emit(result)


if __name__ == "__main__":
    main(sys.argv[1])
