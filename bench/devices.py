"""kvwire on an accelerator: decode and prefill against transformers' fastest generate, steering's
cost, and the same machine's CPU.

    python bench/devices.py --device cuda [--weights random|preset] [--models smollm2-135m-instruct gemma3-270m]
                            [--dtype bfloat16] [--batch 1 16] [--new-tokens 64] [--prefill 512]
                            [--modes eager compiled cudagraphs] [--peers transformers] [--steer-rows 16]
                            [--out FOLDER] [--budget SECONDS] [--tiny]

`--weights random` (the default) builds each preset's architecture from its configuration (below)
with seeded random weights, so no model file is needed; the speed of a step does not depend on the
weights' values. `--weights preset` loads the installed preset packages instead (float weights).

Measured on the device, each in one process and one run:
- kvwire, each of `--modes`: `eager`; `compiled` (`lm.compile(ahead=False)`: torch.compile's steps,
  caches written in place); `cudagraphs` (`lm.compile(mode="reduce-overhead")`: CUDA graphs of the
  decode steps).
- transformers (`--peers transformers`): the same weights through its own `generate` with its static
  cache, which on CUDA compiles the forward with `mode="reduce-overhead"` (its documented fastest
  setting; on a CPU it runs eager: the line says which).
- decode tokens/s per row at each batch size: (n - 1) / (time(n new tokens) - time(1 new token)),
  greedy, best of 3 after a warm-up, prompts of 16 random tokens; the prefill and first token
  cancel out. Every call ends synchronised (generation reads its tokens back; the peer's calls end
  with `torch.cuda.synchronize`).
- prefill: one prompt of `--prefill` tokens to its first token, tokens/s, best of 3.
- steering: kvwire decode at batch `--steer-rows` with a control vector on every block at as many
  distinct per-row strengths, against no steering, same mode; the cost is 1 - steered / plain.
- the CPU of the same machine: kvwire float32 decode b1 (the ratio device / CPU), and greedy tokens
  of a float32 model on the device against the CPU's (tokens equal before the first difference).

Order: every model's eager steps, the peer and the CPU first, then the compiled modes (minutes of
compiling). Each result is printed and appended to FOLDER/results.jsonl as it is measured (with
--out), so a run cut short keeps what it measured; with --budget, measurements that would start
after that many seconds are skipped and say so; the ratios come last. `--tiny` shrinks every configuration to 2 layers and a 512-token
vocabulary (a check of the bench itself, e.g. with --device cpu).

Exits with status 2 and the reason when the device cannot be used in this process.
"""
import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

# the presets' architectures, as their GGUF files describe them (tests/test_bench_devices.py checks
# them against the installed presets' metadata)
CONFIGS = {
    "smollm2-135m-instruct": ("llama", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
    "gemma3-270m": ("gemma3_text", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, tie_word_embeddings=True)),
}
TINY = dict(num_hidden_layers=2, vocab_size=512)
PROMPT_TOKENS = 16


class Report:
    """Prints each result and appends it to FOLDER/results.jsonl (flushed) as it comes."""

    def __init__(self, folder, budget):
        self.file = None
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(folder) / "results.jsonl", "a")
        self.start, self.budget, self.records = time.monotonic(), budget, []

    def left(self, what):
        """False (and a line saying so) when `what` would start past the budget."""
        if self.budget is None or time.monotonic() - self.start < self.budget:
            return True
        self.add(what, None, note=f"skipped: past the {self.budget:.0f} s budget")
        return False

    @contextlib.contextmanager
    def failure(self, what):
        """A measurement that raises is a line with its error (and its traceback on stderr); the
        others go on."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure of one measurement is reported, not fatal
            traceback.print_exc()
            self.add(what, None, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])

    def add(self, what, value, unit="", note="", **fields):
        self.records.append(dict(what=what, value=value, **fields))
        shown = "-" if value is None else f"{value:10.2f} {unit}"
        print(f"  {what:<58} {shown}{'  ' + note if note else ''}", flush=True)
        if self.file is not None:
            self.file.write(json.dumps(dict(what=what, value=value, unit=unit, note=note, **fields)) + "\n")
            self.file.flush()


def hf_model(name, tiny, seed=0):
    """transformers' model of a preset's architecture with seeded random weights (float32, CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, options = CONFIGS[name]
    config = AutoConfig.for_model(model_type, **{**options, **(TINY if tiny else {})})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # random weights: every run makes its full budget
    model.generation_config.pad_token_id = 0
    return model


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, repeat=3):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_rate(generate, ids, new_tokens):
    """Decode tokens/s per row of `generate(ids, n)`: (n - 1) / (time(n tokens) - time(1 token)), best of
    3 each, after a warm-up at both lengths (kernels, compiled graphs and caches of both buckets)."""
    generate(ids, 2)
    generate(ids, new_tokens)
    return (new_tokens - 1) / max(best_time(lambda: generate(ids, new_tokens)) - best_time(lambda: generate(ids, 1)),
                                  1e-9)


def prompts(batch, vocab, length=PROMPT_TOKENS, seed=1):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def kvwire_calls(lm, device):
    """generate(ids (B, T), n): n new tokens a row from a kvwire model."""
    def generate(ids, n):
        lm.generate(list(ids.to(device)), max_new_tokens=n, ignore_eos=True)

    return generate


def transformers_calls(model, device, new_tokens):
    """generate(ids (B, T), n) through transformers' generate with its static cache, one cache per prompt
    shape kept across calls (reset before each) so every call runs the same compiled graphs."""
    from transformers import StaticCache

    caches = {}

    def generate(ids, n):
        ids = ids.to(device)
        key = tuple(ids.shape)
        if key not in caches:
            caches[key] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
        cache = caches[key]
        cache.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values: the name older releases know
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)
        synchronize(device)

    return generate


def measure(report, label, generate, args, vocab, batches, **fields):
    """Decode at each batch size, and prefill (a prompt to its first token), through `generate(ids, n)`."""
    for batch in batches:
        if not report.left(f"{label} decode b{batch}"):
            continue
        ids = prompts(batch, vocab)
        rate = decode_rate(generate, ids, args.new_tokens)
        report.add(f"{label} decode b{batch}", rate, "tokens/s per row", metric="decode", batch=batch, **fields)
    if args.prefill and report.left(f"{label} prefill {args.prefill}"):
        ids = prompts(1, vocab, args.prefill)
        generate(ids, 1)
        rate = args.prefill / best_time(lambda: generate(ids, 1))
        report.add(f"{label} prefill {args.prefill}", rate, "tokens/s", metric="prefill", batch=1, **fields)


def compiled(lm, mode):
    if mode == "compiled":
        return lm.compile(ahead=False)
    if mode == "cudagraphs":
        return lm.compile(mode="reduce-overhead")
    return lm


def steering_cost(report, lm, mode, args, vocab, **fields):
    """Decode at `--steer-rows` rows: `lm` (compiled as `mode`) against the same model steered on every
    block at a distinct strength per row (compiled the same way)."""
    import kvwire as kw

    rows = args.steer_rows
    if not report.left(f"kvwire {mode} steering, {rows} rows"):
        return
    g = torch.Generator().manual_seed(2)
    width = lm.head.weight.shape[1]
    vec = kw.ControlVector({i: torch.randn(width, generator=g) for i in range(len(lm.backbone.layers))})
    strengths = torch.linspace(-2.0, 2.0, rows)  # a distinct strength per row
    steered = compiled(lm.steer(vec, strengths), mode)
    ids = prompts(rows, vocab)
    rates = {}
    for name, model in (("plain", lm), ("steered", steered)):
        rates[name] = decode_rate(kvwire_calls(model, lm.device), ids, args.new_tokens)
    report.add(f"kvwire {mode} decode b{rows}, {rows} distinct strengths", rates["steered"], "tokens/s per row",
               metric="steered", batch=rows, **fields)
    report.add(f"kvwire {mode} steering cost at b{rows}", 100 * (1 - rates["steered"] / rates["plain"]), "%",
               note=f"(plain {rates['plain']:.1f})", metric="steering_cost", batch=rows, **fields)


def cpu_reference(report, hf, lm_device, args, vocab, **fields):
    import kvwire as kw

    if not report.left("CPU reference"):
        return
    cpu = kw.from_hf(hf, dtype="float32")
    generate = kvwire_calls(cpu, torch.device("cpu"))
    ids = prompts(1, vocab)
    rate = decode_rate(generate, ids, args.new_tokens)
    report.add(f"kvwire eager decode b1 on this CPU (float32, {torch.get_num_threads()} threads)", rate,
               "tokens/s", metric="cpu_decode", batch=1, **fields)
    full = kw.from_hf(hf, dtype="float32", device=lm_device)
    rows = list(prompts(4, vocab, seed=3))
    want = cpu.generate(rows, max_new_tokens=32, ignore_eos=True)
    got = full.generate([r.to(lm_device) for r in rows], max_new_tokens=32, ignore_eos=True)
    same = sum(next((i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())) if x != y), len(a))
               for a, b in zip(want, got))
    report.add(f"greedy tokens equal to the CPU's (float32, {len(rows)} prompts)", same, f"of {32 * len(rows)}",
               metric="agreement", **fields)


def ratios(report, name):
    """kvwire's best mode over transformers at each decode batch and prefill; the device over its CPU."""
    mine = [r for r in report.records if r.get("model") == name and r["value"] is not None]

    def best(side, metric, batch):
        values = [r["value"] for r in mine if (r.get("side"), r.get("metric"), r.get("batch")) == (side, metric, batch)]
        return max(values, default=None)

    for metric, batch in sorted({(r["metric"], r["batch"]) for r in mine if r.get("side") == "kvwire"
                                 and r.get("metric") in ("decode", "prefill")}):
        ours, theirs = best("kvwire", metric, batch), best("transformers", metric, batch)
        if theirs:
            report.add(f"{name}: kvwire best / transformers, {metric} b{batch}", ours / theirs, "x",
                       metric="ratio_peer", of=metric, batch=batch, model=name)
    ours, cpu = best("kvwire", "decode", 1), best(None, "cpu_decode", 1)
    if ours and cpu:
        report.add(f"{name}: kvwire best decode b1 / this CPU's", ours / cpu, "x", metric="ratio_cpu", model=name)


def bench_model(report, name, device, args, modes, first):
    """One model: kvwire in each of `modes`; with `first`, also the peer and the CPU reference."""
    import kvwire as kw

    print(f"{name} ({args.weights} weights, {args.dtype}{', tiny' if args.tiny else ''}; "
          f"{' '.join(modes) or 'peers'}):", flush=True)
    fields = dict(model=name, dtype=args.dtype, device=str(device))
    hf = hf_model(name, args.tiny) if args.weights == "random" else None

    def make():  # a model per mode: each compiles its own steps
        if hf is None:
            return kw.load(name, dtype=args.dtype, progress=False, device=device)
        return kw.from_hf(hf, dtype=args.dtype, device=device)

    try:
        vocab = make().vocab_size
    except ValueError as e:  # a preset whose package is not installed
        report.add(f"{name}", None, note=f"skipped ({e})")
        return
    for mode in modes:
        if report.left(f"kvwire {mode}"):
            with report.failure(f"kvwire {mode}"):
                model = compiled(make(), mode)
                measure(report, f"kvwire {mode}", kvwire_calls(model, device), args, vocab, args.batch,
                        side="kvwire", mode=mode, **fields)
                if args.steer_rows:
                    steering_cost(report, model, mode, args, vocab, side="kvwire", **fields)
    if first and "transformers" in args.peers and hf is not None and report.left("transformers"):
        how = "static cache, compiled" if device.type in ("cuda", "xpu") else "static cache, eager on this device"
        with report.failure("transformers"):
            peer = hf_model(name, args.tiny).to(device=device, dtype=getattr(torch, args.dtype))
            measure(report, f"transformers ({how})", transformers_calls(peer, device, args.new_tokens), args,
                    vocab, args.batch, side="transformers", mode=how, **fields)
    if first and args.cpu_reference and hf is not None:
        with report.failure("CPU reference"):
            cpu_reference(report, hf, device, args, vocab, **fields)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="the accelerator to measure (cuda, cuda:1, ...)")
    p.add_argument("--weights", default="random", choices=["random", "preset"])
    p.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement (0: none)")
    p.add_argument("--modes", nargs="+", default=["eager", "cudagraphs"], choices=["eager", "compiled", "cudagraphs"])
    p.add_argument("--peers", nargs="*", default=["transformers"], choices=["transformers"])
    p.add_argument("--steer-rows", type=int, default=16, help="rows of the steering measurement (0: none)")
    p.add_argument("--cpu-reference", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--out", default=None, metavar="FOLDER", help="append each result to FOLDER/results.jsonl")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="skip measurements that would start after this many seconds")
    p.add_argument("--tiny", action="store_true", help="2-layer configurations (a check of the bench itself)")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    if any(b < 1 for b in args.batch) or args.prefill < 0 or args.steer_rows < 0:
        p.error("--batch must be >= 1, --prefill and --steer-rows >= 0")
    from kvwire.dtypes import weights_device

    try:
        device = weights_device(args.device)
    except (ValueError, TypeError) as e:
        print(f"bench/devices.py: {e}; nothing measured", file=sys.stderr)
        return 2
    if args.weights == "preset" and "transformers" in args.peers:
        print("bench/devices.py: --weights preset runs kvwire alone (the peer needs the random models' "
              "transformers weights)", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or str(device)
    print(f"device: {device} ({name}); torch {torch.__version__}; CPU: {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads; {args.new_tokens} new tokens; modes {' '.join(args.modes)}", flush=True)
    report = Report(args.out, args.budget)
    report.add("device", None, note=f"{device} ({name}), torch {torch.__version__}", metric="header")
    # eager steps, the peer and the CPU first for every model; compiled modes (minutes of compiling)
    # after, so a budget cuts those
    eager = [m for m in args.modes if m == "eager"]
    for model in args.models:
        bench_model(report, model, device, args, eager, first=True)
    later = [m for m in args.modes if m != "eager"]
    for model in args.models if later else []:
        bench_model(report, model, device, args, later, first=False)
    for model in args.models:
        ratios(report, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
