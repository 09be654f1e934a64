"""Generation speed, load time and peak memory of a preset model: kvwire vs llama.cpp and
transformers, all three on the same GGUF file.

    python bench/generate.py [--model gemma3-270m | smollm2-135m-instruct] [--new-tokens 32] [--threads 2]
                             [--peers transformers llama.cpp]
                             [--variants float32 bfloat16 bfloat16+int8 bfloat16+int4 float32+gguf
                                         float32+gguf+compile]

kvwire loads the preset (`kw.load(model)`), llama.cpp (llama-cpp-python) opens the preset's GGUF
file and transformers loads the same file (`from_pretrained(folder, gguf_file=...)`, dequantised
to the variant's dtype, as kvwire dequantises it), so one code path serves every preset. A variant
is a dtype, optionally with weight-only quantisation ("bfloat16+int4" =
`kw.load(dtype="bfloat16", quantize="int4")`; "+gguf" keeps the GGUF's own blocks on ggml's kernels;
"+head=q5_0" re-quantises the logits head alone; "+compile" adds `lm.compile()`, compiled before
timing, "+cpp" the same with Inductor's C++ wrapper); transformers runs the float variants only, and
quantised variants are compared with llama.cpp on the GGUF's own blocks. Prints decode tokens/s at
batch 1 and 4, prefill tokens/s for 32- and 512-token prompts, peak RSS, load seconds, and the
kvwire / peer ratios.

Load and memory: every library is loaded in two processes of its own, one after the other. "cold"
is the first, with an empty kvwire cache (KVWIRE_CACHE is a fresh directory per variant, so kvwire
converts the GGUF); "warm" the second. The OS file cache is not dropped, and the peers keep no cache
of their own, so their two loads differ little. Load time counts neither the library's import nor
compilation (a "+compile" variant compiles on its first call). Peak RSS is the warm process's over
a 512-token prefill and 8 decode steps at batch 4.

Speed: every library is loaded in a process of its own and this process drives them in turn,
one run at a time, each timing its own runs (`common.LibraryProcess`): libraries never share a
process (thread pools, heap, allocator state), and their runs still interleave, so a noisy
machine's drift hits them alike; each run starts `SETTLE_S` after the last ended (see there).
(llama.cpp's OpenMP pool was suspected of slowing torch in one process; runs of both designs on
the 2-core Intel Xeon with AMX, 2026-12-03, an hour apart, gave kvwire/transformers float32
1.06x / 1.43x / 0.89x / 0.95x in one process and 1.04x / 1.50x / 0.86x / 0.93x apart: no clear
effect, but no shared state to doubt.)

A peer that is missing, raises or crashes does not take the table with it: each peer is first
probed in its own process (load + 2 tokens) and one that fails gets a row saying what happened
("killed by SIGSEGV", the exception) and is left out of the timed run; one that dies while timed
gets a row saying so and the others are timed on. (Test only: KVWIRE_BENCH_CRASH_PEER=llama.cpp
makes that peer segfault; "llama.cpp@timed" only in the timed run.)
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import (LibraryDied, LibraryProcess, answer_requests, cpu_paths, crash_if_asked, header,  # noqa: E402
                    load_variant, parse_variant, peak_rss_gb, probe_peers, run_worker)

TEXT = ("The history of the city of Paris begins with a small settlement on an island in the river Seine. "
        "Over two thousand years it grew into one of the great capitals of the world, ") * 40


def prompt_ids(encode, length, batch):
    """`batch` rows of `length` token ids (lists: llama.cpp's process never imports torch)."""
    ids = encode(TEXT)[:length]
    assert len(ids) == length
    return [[ids[0]] + [(t + r) % 20_000 + 3 for t in ids[1:]] for r in range(batch)]  # distinct rows


def counting(text):
    """Token ids without a tokenizer, for probes and memory runs (what they hold does not matter)."""
    return list(range(100, 700))


# libgomp's workers (torch's OpenMP) spin after a parallel region before they sleep (GOMP_SPINCOUNT;
# 4-7 ms of CPU after a 1024 x 1024 product on a 2-core Xeon with AMX, 2026-12-04): a run that starts
# right after another library's shares the cores with that library's spinning thread. Same machine,
# `--variants bfloat16`, one run each: kvwire prefill 32 / 512 at 699 / 3015 tokens/s timed alone,
# 579 / 2894 interleaved with transformers and no pause, 619 / 2984 with this one.
SETTLE_S = 0.1


def measure(runners, encode, new_tokens, repeat=3, settle=SETTLE_S):
    """({library: {key: rate}}, {library: why it stopped}) for runners: {library: run(ids (B, T), n) ->
    seconds} running n new tokens with no early stop, each timed where it runs.

    Libraries are timed in turn inside each repetition and the best time is kept, so the drift of a
    noisy machine hits them alike. Each run starts `settle` seconds after the last one ended, so the
    last library's thread pool has gone to sleep (see SETTLE_S). A runner that raises `LibraryDied`
    is timed no further: it gets a reason instead of rates, and the others go on."""
    plans = {}
    for batch in (1, 4):
        ids = prompt_ids(encode, 16, batch)
        # NaN, not a negative rate, when noise made the best N-token run faster than the best 1-token one
        plans[f"decode_b{batch}"] = (ids, lambda t1, tn, b=batch: b * (new_tokens - 1) / (tn - t1) if tn > t1
                                     else float("nan"))
    for length in (32, 512):
        ids = prompt_ids(encode, length, 1)
        plans[f"prefill_{length}"] = (ids, lambda t1, tn, n=length: n / t1)
    best = {lib: {k: [float("inf"), float("inf")] for k in plans} for lib in runners}
    died = {}

    def timed(lib, ids, n):
        if lib in died:
            return float("inf")
        time.sleep(settle)
        try:
            return runners[lib](ids, n)
        except LibraryDied as e:
            died[lib] = f"not timed: died while timed: {e}"
            return float("inf")
    for lib in runners:
        timed(lib, prompt_ids(encode, 16, 1), 2)  # warm up
    for _ in range(repeat):
        for key, (ids, _) in plans.items():
            for lib in runners:
                times = best[lib][key]
                times[0] = min(times[0], timed(lib, ids, 1))
                if key.startswith("decode"):
                    times[1] = min(times[1], timed(lib, ids, new_tokens))
    rates = {lib: {k: plans[k][1](*best[lib][k]) for k in plans} for lib in runners if lib not in died}
    return rates, died


def timing(generate):
    """generate(ids, n) -> run(ids, n) returning its wall seconds (a `measure` runner in this process)."""
    def run(ids, n):
        start = time.perf_counter()
        generate(ids, n)
        return time.perf_counter() - start
    return run


def kvwire_runner(lm):
    import torch

    def generate(ids, n):
        out = lm.generate(torch.tensor(ids), max_new_tokens=n, ignore_eos=True)
        assert all(len(o) == n for o in out)
    return generate


def transformers_runner(gguf, variant):
    """transformers' own model of the file's architecture, dequantised from the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf)
    dtype = getattr(torch, parse_variant(variant)["dtype"])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()

    def generate(ids, n):
        crash_if_asked("transformers")
        ids = torch.tensor(ids)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n
    return generate


def llama_cpp_runner(gguf, threads):
    from llama_cpp import Llama

    llm = Llama(gguf, n_threads=threads, n_ctx=1024, verbose=False)

    def generate(ids, n):
        crash_if_asked("llama.cpp")
        for row in ids:  # llama-cpp-python generates one sequence at a time
            llm.reset()
            for count, _ in enumerate(llm.generate(row, temp=0.0), start=1):
                if count == n:
                    break
    return generate


PEERS = {"transformers": lambda gguf, variant, threads: transformers_runner(gguf, variant),
         "llama.cpp": lambda gguf, variant, threads: llama_cpp_runner(gguf, threads)}


def open_library(lib, variant, args):
    """generate(ids, n) of `lib` on args.model (kvwire: the preset; peers: its GGUF file)."""
    if lib == "kvwire":
        return kvwire_runner(load_variant(variant, args.model))
    return PEERS[lib](args.gguf, variant, args.threads)


def import_library(lib, threads):
    """Import `lib` (and torch, but for llama.cpp) and set torch's threads: load time counts neither."""
    if lib == "llama.cpp":
        import llama_cpp  # noqa: F401
        return
    import torch
    if lib == "transformers":
        from transformers import AutoModelForCausalLM  # noqa: F401
    else:
        import kvwire  # noqa: F401
    torch.set_num_threads(threads)


def probe(peer, variant, args):
    """Load `peer` and generate 2 tokens (in a child process of its own: it may crash); for
    llama.cpp also the CPU features its build uses."""
    import_library(peer, args.threads)
    open_library(peer, variant, args)(prompt_ids(counting, 16, 1), 2)
    if peer == "llama.cpp":
        import llama_cpp

        try:  # "CPU : SSE3 = 1 | ... | AMX_INT8 = 1 | OPENMP = 1 | "; another version may say it otherwise
            info = llama_cpp.llama_print_system_info().decode()
            on = [part.split("=")[0].split(":")[-1].strip() for part in info.split("|") if part.strip().endswith("= 1")]
            return {"probed": peer, "build": " ".join(on)}
        except Exception as e:  # noqa: BLE001 - the probe is about running, not this line
            return {"probed": peer, "build": f"unknown ({type(e).__name__})"}
    return {"probed": peer}


AMX_HINT = ("if this is the known crash, llama-cpp-python built natively on an AMX CPU segfaults in ggml's "
            "AMX matmul (ggml_backend_amx_mul_mat); README, Benchmarks, builds one without AMX")


def footprint(lib, variant, args):
    """{load_s, peak_rss_gb}: `lib` alone in this process; peak RSS over a 512-token prefill and
    8 decode steps at batch 4 (not measured with args.load_only)."""
    import_library(lib, args.threads)
    start = time.perf_counter()
    generate = open_library(lib, variant, args)
    result = {"load_s": time.perf_counter() - start}
    if not args.load_only:
        generate(prompt_ids(counting, 512, 1), 2)
        generate(prompt_ids(counting, 16, 4), 8)
        result["peak_rss_gb"] = peak_rss_gb()
    return result


def serve(lib, variant, args):
    """The child of `speed` for `lib`: load it (a "+compile" variant compiles both batch sizes), then
    time each `generate` request (ids, n) and answer in seconds; kvwire also encodes the prompts' text
    (its tokenizer is the preset's)."""
    import_library(lib, args.threads)
    if lib == "kvwire":
        lm = load_variant(variant, args.model)
        generate = kvwire_runner(lm)
        if parse_variant(variant)["compile"]:
            for batch in (1, 4):  # compile both batch sizes before anything is timed
                generate(prompt_ids(lm.tokenizer.encode, 16, batch), 2)
    else:
        generate = open_library(lib, variant, args)

    run = timing(generate)

    def handle(request):
        if request["op"] == "encode":
            return {"ids": lm.tokenizer.encode(request["text"])}
        return {"seconds": run(request["ids"], request["n"])}
    answer_requests(handle)


def speed(variant, peers, args, forwarded, env):
    """({library: {key: tokens/s}}, {library: why not}) of kvwire and `peers`, each library loaded and
    timed in a process of its own (`common.LibraryProcess`), their runs interleaved by this one: no
    two libraries share a process's thread pools or heap."""
    children, why_not = {}, {}
    try:
        for lib in ["kvwire", *peers]:
            try:
                children[lib] = LibraryProcess(__file__, ["--serve", lib, variant, *forwarded], env)
            except LibraryDied as e:
                why_not[lib] = f"not timed: {e}"
            if "kvwire" not in children:  # the prompts are kvwire's tokenizer's: no peer is loaded
                return {}, {**why_not, **{peer: "not timed: kvwire failed (the row above)" for peer in peers}}
        try:
            text_ids = children["kvwire"].ask(op="encode", text=TEXT)["ids"]
        except LibraryDied as e:
            return {}, {**why_not, "kvwire": f"not timed: {e}",
                        **{peer: "not timed: kvwire failed (the row above)" for peer in children if peer != "kvwire"}}
        runners = {lib: (lambda ids, n, child=child: child.ask(op="generate", ids=ids, n=n)["seconds"])
                   for lib, child in children.items()}
        rates, died = measure(runners, lambda text: text_ids, args.new_tokens)
        return rates, {**why_not, **died}
    finally:
        for child in children.values():
            child.close()


KEYS = ["decode_b1", "decode_b4", "prefill_32", "prefill_512"]
COLUMNS = KEYS + ["peak RSS GB", "load cold s", "load warm s"]


def row(lib, label, cells):
    """A table row: numbers, or one text cell saying why there are none."""
    text = "".join(f"{c:13.2f}" for c in cells) if isinstance(cells, list) else f"  {cells}"
    return f"{lib:14}{label:32}" + text


def footprints(lib, variant, forwarded, env):
    """[peak RSS GB, cold load s, warm load s] of `lib` (NaN where a process failed) and footnotes."""
    argv = ["--worker", lib, variant, *forwarded]
    cold = run_worker(__file__, [*argv, "--load-only"], env)
    warm = run_worker(__file__, argv, env)
    cells = [r.value[key] if r.ok else float("nan") for r, key in ((warm, "peak_rss_gb"), (cold, "load_s"),
                                                                    (warm, "load_s"))]
    notes = [f"{lib} {variant}: {what} not measured: {r.failure}" for r, what in
             ((cold, "cold load"), (warm, "warm load and peak RSS")) if not r.ok]
    return cells, notes


def report(variant, peers, speed, why_not, sizes, label):
    """Print one variant's rows: kvwire and every peer (timed, or why not), then the ratios.
    sizes: {lib: [peak RSS, cold load, warm load]}."""
    quantised = parse_variant(variant)["quantize"] is not None
    for lib in ["kvwire", *peers]:
        # transformers runs the variant's dtype, eager, whatever else kvwire's variant names
        name = {"kvwire": variant, "llama.cpp": label}.get(lib, f"{parse_variant(variant)['dtype']} (eager)")
        print(row(lib, name, [speed[lib][k] for k in KEYS] + sizes[lib]) if lib in speed else
              row(lib, name, why_not.get(lib, "not timed")))
    for lib in peers:
        if (lib == "llama.cpp") == quantised and lib in speed and "kvwire" in speed:
            ours, theirs = [speed["kvwire"][k] for k in KEYS] + sizes["kvwire"], \
                [speed[lib][k] for k in KEYS] + sizes[lib]
            print(f"{'  kvwire/' + lib:46}" + "".join(f"{a / b:13.2f}" for a, b in zip(ours, theirs)))


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3-270m", help="a kvwire preset: gemma3-270m, smollm2-135m-instruct")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["float32", "bfloat16+int4", "float32+gguf", "float32+gguf+compile"])
    p.add_argument("--worker", nargs=2, metavar=("LIBRARY", "VARIANT"))  # internal: load time and peak RSS
    p.add_argument("--peers", nargs="*", choices=list(PEERS), help="the peers to run (default: all of them)")
    p.add_argument("--serve", nargs=2, metavar=("LIBRARY", "VARIANT"))  # internal: a timed library's process
    p.add_argument("--probe", choices=list(PEERS))
    p.add_argument("--probe-variant", default="float32")
    p.add_argument("--gguf", help="internal: the preset's GGUF file, resolved once by the parent")
    p.add_argument("--load-only", action="store_true")
    return p


def forwarded(args, gguf):
    """The options every worker and probe gets from the parent."""
    return ["--model", args.model, "--gguf", gguf, "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]


def gguf_of(model, p):
    """The preset's GGUF file and its llama.cpp file type ("Q4_1"); a parser error for no preset."""
    from gguf import LlamaFileType

    from kvwire.io.gguf import GGUFFile
    from kvwire.models.presets import PRESETS

    if model not in PRESETS:
        p.error(f"--model {model!r} is not a preset; expected one of {sorted(PRESETS)}")
    path = PRESETS[model]()
    return path, LlamaFileType(GGUFFile(path).field("general.file_type")).name.removeprefix("MOSTLY_")


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe, args.probe_variant, args)))
        return
    if args.worker:
        print(json.dumps(footprint(*args.worker, args)))
        return
    if args.serve:
        serve(*args.serve, args)
        return
    gguf, file_type = gguf_of(args.model, p)
    print(header(args.threads), flush=True)
    print(cpu_paths(), flush=True)
    print(f"model: {args.model} ({os.path.basename(gguf)}, {file_type})", flush=True)
    common = forwarded(args, gguf)
    floats = [v for v in args.variants if parse_variant(v)["quantize"] is None]
    # llama.cpp runs the GGUF's own blocks whatever the variant; it is timed in every run
    # (interleaved with kvwire) and compared with the quantised variants
    chosen = PEERS if args.peers is None else args.peers
    wanted = [peer for peer in (["transformers"] if floats else []) + ["llama.cpp"] if peer in chosen]
    probes = probe_peers(__file__, wanted, ["--probe-variant", (floats or ["float32"])[0], *common])
    failed = {peer: f"not timed: {r.failure} (probe: load + 2 tokens)" for peer, r in probes.items() if not r.ok}
    llama = probes.get("llama.cpp")
    if llama is not None and llama.ok:
        print(f"llama.cpp build features: {llama.value.get('build', '?')}", flush=True)
    elif llama is not None and llama.failure == "killed by SIGSEGV" and "amx_tile+" in header(args.threads):
        print(f"llama.cpp: {AMX_HINT}", flush=True)
    print(f"{'library':14}{'variant':32}" + "".join(f"{k:>13}" for k in COLUMNS))
    later, peer_sizes = [], {}  # a peer's footprint depends on its dtype only, not on kvwire's variant
    for variant in args.variants:
        quantised = parse_variant(variant)["quantize"] is not None
        these = [peer for peer in ([] if quantised else ["transformers"]) + ["llama.cpp"] if peer in chosen]
        timed = [peer for peer in these if peer not in failed]
        with tempfile.TemporaryDirectory() as cache:  # kvwire's cold load converts the GGUF
            env = {"KVWIRE_CACHE": cache}
            sizes = {"kvwire": footprints("kvwire", variant, common, env)}
            for peer in timed:
                key = (peer, parse_variant(variant)["dtype"] if peer == "transformers" else "")
                if key not in peer_sizes:
                    peer_sizes[key] = footprints(peer, variant, common, env)
                sizes[peer] = peer_sizes[key]
            timed_rates, timed_why = speed(variant, timed, args, common, env)
        why_not = {**failed, **timed_why}
        for _, notes in sizes.values():
            later += [n for n in notes if n not in later]
        report(variant, these, timed_rates, why_not, {lib: s[0] for lib, s in sizes.items()}, file_type)
    print("tokens/s (decode counts every row of the batch), best of 3 interleaved runs, each library in a process "
          "of its own; load: seconds in a process "
          "of its own, cold = empty kvwire cache; kvwire/peer ratios: above 1 is faster in tokens/s, below 1 "
          "smaller or quicker in RSS and load")
    for line in later:
        print(line)


if __name__ == "__main__":
    main()
