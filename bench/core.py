"""Load time, decode speed, peak memory and cache size of the default model: kvwire vs transformers.

Each measurement runs in its own subprocess (so peak RSS is per library), all in one command:

    python bench/core.py [--new-tokens 64] [--threads 2]

Prints a table and the ratios the core issue targets. A worker that crashes or raises leaves its
cells empty ("-") and a line below the table says what happened; the rest is printed.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import crash_if_asked, header, peak_rss_gb, run_worker  # noqa: E402

PROMPT = "The history of the city of Paris begins"


def timed_generate(generate, new_tokens):
    """Decode tokens/s from two runs: 1 new token (prefill) and N new tokens; plus prefill seconds."""
    generate(2)  # warm up
    start = time.perf_counter()
    generate(1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    generate(new_tokens)
    total = time.perf_counter() - start
    return {"prefill_s": prefill, "decode_tok_s": (new_tokens - 1) / (total - prefill)}


def worker_kvwire(args):
    import torch

    import kvwire as kw

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    lm = kw.load("gemma3-270m", progress=False)
    result = {"load_s": time.perf_counter() - start}
    if args.load_only:
        return result
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))

    def generate(n):
        # min length: generation must not stop early at EOS, or tokens/s would be wrong
        out = lm.generate_ids(ids, max_new_tokens=n)
        assert len(out.tokens[0]) == n, "stopped at EOS; pick another prompt"

    result.update(timed_generate(generate, args.new_tokens))
    cache = lm.cached.init_cache(1, 8192)
    result["cache_bytes_8192"] = sum(t.numel() * t.element_size() for pair in cache for t in pair)
    c = lm.config
    full = sum(t == "full_attention" for t in c.layer_types)
    sliding = c.num_hidden_layers - full
    per_token = 2 * c.num_key_value_heads * c.head_dim * 4
    result["cache_min_bytes_8192"] = per_token * (full * 8192 + sliding * (c.sliding_window - 1))
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def worker_transformers(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvwire.models.presets import gemma3_270m

    torch.set_num_threads(args.threads)
    path = gemma3_270m()
    folder, name = os.path.dirname(path), os.path.basename(path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    result = {"load_s": time.perf_counter() - start}
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]

    def generate(n):
        crash_if_asked("transformers")
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    result.update(timed_generate(generate, args.new_tokens))
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def run(worker, args, env=None):
    load_only = worker == "kvwire-load"
    argv = ["--worker", "kvwire" if load_only else worker, "--new-tokens", str(args.new_tokens),
            "--threads", str(args.threads)] + (["--load-only"] if load_only else [])
    return run_worker(__file__, argv, env)


def cells(ours, theirs, key, digits=2, ratio=None):
    """kvwire's and transformers' `key` formatted (- where a worker failed), and their ratio."""
    a, b = (r.value[key] if r.ok else None for r in (ours, theirs))
    text = "".join(f"{'-' if v is None else f'{v:.{digits}f}':>{w}}" for v, w in ((a, 12), (b, 14)))
    if ratio and a is not None and b is not None:
        text += f"{ratio(a, b):8.2f}"
    return text


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load-only", action="store_true")
    args = p.parse_args()
    if args.worker:
        fn = {"kvwire": worker_kvwire, "transformers": worker_transformers}[args.worker]
        print(json.dumps(fn(args)))
        return
    print(header(args.threads), flush=True)
    with tempfile.TemporaryDirectory() as cache:
        first = run("kvwire-load", args, {"KVWIRE_CACHE": cache})
        ours = run("kvwire", args, {"KVWIRE_CACHE": cache})
    theirs = run("transformers", args)
    print(f"{'':28}{'kvwire':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'load, first use (s)':28}" + cells(first, theirs, "load_s"))
    print(f"{'load, cached (s)':28}" + cells(ours, theirs, "load_s", ratio=lambda a, b: b / a))
    print(f"{'prefill, 9 tokens (s)':28}" + cells(ours, theirs, "prefill_s", 3, ratio=lambda a, b: b / a))
    print(f"{'decode fp32 (tok/s)':28}" + cells(ours, theirs, "decode_tok_s", ratio=lambda a, b: a / b))
    print(f"{'peak RSS (GB)':28}" + cells(ours, theirs, "peak_rss_gb"))
    if ours.ok:
        print(f"cache bytes for 8192 tokens: {ours.value['cache_bytes_8192']:,} "
              f"(ring-buffer minimum {ours.value['cache_min_bytes_8192']:,})")
    for name, result in (("kvwire, first load", first), ("kvwire", ours), ("transformers", theirs)):
        if not result.ok:
            print(f"{name}: not measured: {result.failure}")


if __name__ == "__main__":
    main()
