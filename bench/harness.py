"""lm-evaluation-harness loglikelihood throughput: the `kvwire` model vs lm-eval's own `hf` model on
the same weights (a preset's GGUF file: kvwire loads the preset, transformers the same file), on a
local multiple-choice task written here (no downloads).

    python bench/harness.py [--model smollm2-135m-instruct] [--docs 48] [--batch-size 16] [--threads 2]
                            [--repeat 2]

The task has `--docs` questions of about 60 tokens with 4 answers of 2 to 9 tokens each (the shape
of ARC, HellaSwag or MMLU). lm-eval builds the task's requests; both models are built (load time is
not counted), then each runs lm-eval's `loglikelihood` over all the requests (as `simple_evaluate`
calls it, without the task building, metrics and environment report around it, the same for both)
in turn, `--repeat` times; the best time of each counts. Prints loglikelihood requests
per second of both (wall time; CPU time of the process too, steadier on a busy machine), the ratio
(goal: kvwire >= 1.5x), the largest difference between their loglikelihoods and whether they pick
the same answers, and the CPU.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before lm-eval's imports: nothing downloads
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

FACTS = ["The river that runs through the old town freezes every winter, and children skate on it",
         "A lighthouse keeper kept a log of every ship that passed the rocky point for forty years",
         "The bakery on the corner opens at five in the morning and sells out of bread by nine",
         "Migrating birds follow the coastline south, resting in the marshes along the way",
         "The library moved its oldest maps to a cool, dark room to keep the ink from fading",
         "Farmers in the valley plant barley in the spring and harvest it before the autumn rains"]
ANSWERS = ["because the water is shallow and still", "so that nothing would be forgotten",
           "as the town wakes up early", "which gives them food and shelter", "to protect them from the light",
           "before the weather turns", "for no reason at all", "since the mayor ordered it in a letter",
           "while the musicians played in the square", "after the bridge was rebuilt"]


def write_task(folder, docs):
    """A multiple-choice task `bench_mc` over `docs` questions (JSONL + YAML in `folder`), 4 answers each."""
    rows = []
    for i in range(docs):
        story = ". ".join(FACTS[(i + k) % len(FACTS)] for k in range(3))
        choices = [ANSWERS[(i * 3 + k) % len(ANSWERS)] for k in range(4)]
        rows.append({"question": f"{story}. Question {i}: why is this so? Answer:", "choices": choices,
                     "answer": i % 4})
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        f"  cache_dir: {folder / 'datasets'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def models(preset, batch_size):
    """{name: lm-eval model object}: kvwire's and transformers' on the preset's GGUF file, float32."""
    import kvwire.harness
    from lm_eval.models.huggingface import HFLM

    from kvwire.models.presets import PRESETS

    path = Path(PRESETS[preset]())
    return {"kvwire": kvwire.harness.KvwireLM(pretrained=preset, batch_size=batch_size),
            "hf": HFLM(pretrained=str(path.parent), gguf_file=path.name, dtype="float32", batch_size=batch_size,
                       device="cpu")}


def requests_of(manager):
    """The task's loglikelihood requests as lm-eval builds them (`Instance`s, one per answer)."""
    task = manager.load(["bench_mc"])["tasks"]["bench_mc"]
    task.build_all_requests(rank=0, world_size=1)
    return task.instances


def run(lm, requests):
    """(wall seconds, CPU seconds of this process, loglikelihoods) of `lm.loglikelihood` over `requests`."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = lm.loglikelihood(requests, disable_tqdm=True)
    return time.perf_counter() - wall, time.process_time() - cpu, [ll for ll, _ in out]


def chosen(lls):
    """The answer each question's loglikelihoods pick (4 requests a question, in order)."""
    return [max(range(i, i + 4), key=lambda j: lls[j]) for i in range(0, len(lls), 4)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a kvwire preset")
    p.add_argument("--docs", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(args.threads)
    print(header(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), args.docs)
        requests = requests_of(TaskManager(include_path=tmp, include_defaults=False))
    lms = models(args.model, args.batch_size)
    wall, cpu, lls = {}, {}, {}
    for _ in range(args.repeat):  # interleaved: a noisy machine's drift hits both alike
        for name, lm in lms.items():
            w, c, lls[name] = run(lm, requests)
            wall[name], cpu[name] = min(wall.get(name, w), w), min(cpu.get(name, c), c)
    n = len(requests)
    for name in lms:
        print(f"{name:>7}: {n / wall[name]:7.1f} loglikelihood requests/s ({wall[name]:.2f} s wall, {cpu[name]:.2f} s "
              f"CPU for {n} requests of {args.docs} questions, batch {args.batch_size})")
    print(f"kvwire / hf: {wall['hf'] / wall['kvwire']:.2f}x wall, {cpu['hf'] / cpu['kvwire']:.2f}x CPU (goal >= 1.5x)")
    diff = max(abs(a - b) for a, b in zip(lls["kvwire"], lls["hf"]))
    agree = chosen(lls["kvwire"]) == chosen(lls["hf"])
    print(f"largest loglikelihood difference: {diff:.2e}; chosen answers {'agree' if agree else 'DIFFER'}")


if __name__ == "__main__":
    main()
