"""Generation speed of the default model: kvwire vs transformers `generate` on the same weights.

    python bench/generate.py [--new-tokens 32] [--threads 2]
                             [--variants float32 bfloat16 bfloat16+int8 bfloat16+int4 float32+gguf
                                         float32+gguf+compile]

transformers gets kvwire's own Gemma 3 270M weights (same names but the `model.` prefix), so no
GGUF load is needed and both run the same numbers in the same dtype. Each library and dtype runs
in its own subprocess (peak RSS is per process). llama.cpp is measured too when llama-cpp-python
is installed. A variant is a dtype, optionally with weight-only quantisation ("bfloat16+int4" =
`kw.load(dtype="bfloat16", quantize="int4")`; "+gguf" keeps the GGUF's own blocks on ggml's kernels;
"+head=q5_0" re-quantises the logits head alone; "+compile" adds `lm.compile()`, compiled before
timing, "+cpp" the same with Inductor's C++ wrapper); transformers runs the float variants only, and
quantised variants are compared with llama.cpp's 4-bit GGUF. Prints decode tokens/s at batch 1
and 4, prefill tokens/s for 32- and 512-token prompts, peak RSS, and the kvwire / peer ratios.

A peer that is missing, raises or crashes does not take the table with it: each peer is first
probed in its own process (load + 2 tokens) and one that fails gets a row saying what happened
("killed by SIGSEGV", the exception) and is left out of the timed run; if the timed worker still
dies with peers in it, it is re-run with kvwire alone and a note says so. (Test only:
KVWIRE_BENCH_CRASH_PEER=llama.cpp makes that peer segfault; "llama.cpp@timed" only in the timed run.)
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import (crash_if_asked, header, load_variant, parse_variant, peak_rss_gb, probe_peers,  # noqa: E402
                    run_worker, seconds, with_fallback)

TEXT = ("The history of the city of Paris begins with a small settlement on an island in the river Seine. "
        "Over two thousand years it grew into one of the great capitals of the world, ") * 40


def prompt_ids(tokenizer_encode, length, batch):
    ids = tokenizer_encode(TEXT)[:length]
    assert len(ids) == length
    import torch

    rows = torch.tensor(ids)[None].repeat(batch, 1)
    rows[:, 1:] = (rows[:, 1:] + torch.arange(batch)[:, None]) % 20_000 + 3  # distinct rows, same length
    return rows


def measure(runners, encode, new_tokens, repeat=3):
    """runners: {library: generate(ids (B, T), n)} running n new tokens with no early stop.

    Libraries are timed in turn inside each repetition and the best time is kept, so the drift of a
    noisy machine hits them alike."""
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
    for generate in runners.values():
        generate(prompt_ids(encode, 16, 1), 2)  # warm up
    for _ in range(repeat):
        for key, (ids, _) in plans.items():
            for lib, generate in runners.items():
                times = best[lib][key]
                times[0] = min(times[0], seconds(lambda: generate(ids, 1)))
                if key.startswith("decode"):
                    times[1] = min(times[1], seconds(lambda: generate(ids, new_tokens)))
    return {lib: {k: plans[k][1](*best[lib][k]) for k in plans} for lib in runners}


def kvwire_runner(lm):
    def generate(ids, n):
        out = lm.generate(ids, max_new_tokens=n, ignore_eos=True)
        assert all(len(o) == n for o in out)
    return generate


def transformers_runner(lm):
    """transformers' Gemma 3 holding kvwire's own weight tensors (same names but `model.`)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = lm.config
    hf_config = Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, sliding_window=c.sliding_window,
        query_pre_attn_scalar=c.query_pre_attn_scalar, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, layer_types=list(c.layer_types))
    with torch.device("meta"):
        model = Gemma3ForCausalLM(hf_config)
    state = {"model." + k: v for k, v in lm.backbone.state_dict().items()}
    state["lm_head.weight"] = lm.head.weight
    model.load_state_dict(state, assign=True, strict=False)
    model.model.rotary_emb.__init__(hf_config)  # non-persistent buffers were built on meta
    model.model.embed_tokens.embed_scale = torch.tensor(c.hidden_size**0.5)
    model.eval()

    def generate(ids, n):
        crash_if_asked("transformers")
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n
    return generate


def llama_cpp_runner(threads):
    from llama_cpp import Llama

    from kvwire.models.gemma3.presets import gemma3_270m

    llm = Llama(str(gemma3_270m()), n_threads=threads, n_ctx=1024, verbose=False)

    def generate(ids, n):
        crash_if_asked("llama.cpp")
        for row in ids.tolist():  # llama-cpp-python generates one sequence at a time
            llm.reset()
            for count, _ in enumerate(llm.generate(row, temp=0.0), start=1):
                if count == n:
                    break
    return generate


PEERS = {"transformers": lambda lm, threads: transformers_runner(lm),  # holds kvwire's weights
         "llama.cpp": lambda lm, threads: llama_cpp_runner(threads)}  # its own GGUF
PROBE_IDS = [[2, *range(100, 115)]]  # 16 token ids: a probe needs no tokenizer


def probe(peer, variant, threads):
    """Load `peer` and generate 2 tokens (in a child process of its own: it may crash)."""
    import torch

    torch.set_num_threads(threads)
    lm = load_variant(variant) if peer == "transformers" else None
    PEERS[peer](lm, threads)(torch.tensor(PROBE_IDS), 2)
    return {"probed": peer}


def worker(mode, variant, new_tokens, threads, peers):
    import torch

    torch.set_num_threads(threads)
    lm = load_variant(variant)
    if parse_variant(variant)["compile"]:
        for batch in (1, 4):  # compile both batch sizes before anything is timed
            lm.generate(prompt_ids(lm.tokenizer.encode, 16, batch), max_new_tokens=2, ignore_eos=True)
    runners = {"kvwire": kvwire_runner(lm)}
    if mode == "speed":
        for peer in peers:
            runners[peer] = PEERS[peer](lm, threads)
        return measure(runners, lm.tokenizer.encode, new_tokens)
    # mode is a library name: its peak memory, alone in this process, over a 512-token prefill
    # and a few decode steps at batch 4
    encode = lm.tokenizer.encode
    generate = kvwire_runner(lm) if mode == "kvwire" else PEERS[mode](lm, threads)
    del lm
    generate(prompt_ids(encode, 512, 1), 2)
    generate(prompt_ids(encode, 16, 4), 8)
    return {"peak_rss_gb": peak_rss_gb()}


KEYS = ["decode_b1", "decode_b4", "prefill_32", "prefill_512"]


def row(lib, label, cells):
    """A table row: numbers, or one text cell saying why there are none."""
    text = "".join(f"{c:13.2f}" for c in cells) if isinstance(cells, list) else f"  {cells}"
    return f"{lib:14}{label:32}" + text


def report(variant, peers, speed, why_not, common):
    """Print one variant's rows: kvwire and every peer (timed, or why not), then the ratios.
    Returns footnotes (what could not be measured)."""
    quantised = parse_variant(variant)["quantize"] is not None
    footnotes = []
    for lib in ["kvwire", *peers]:
        label = "Q4_K_M" if lib == "llama.cpp" else variant
        if lib not in speed:
            print(row(lib, label, why_not.get(lib, "not timed")))
            continue
        rss = float("nan")
        if lib != "llama.cpp":
            measured = run_worker(__file__, ["--worker", lib, variant, *common])
            if measured.ok:
                rss = measured.value["peak_rss_gb"]
            else:
                footnotes.append(f"{lib} {variant}: peak RSS not measured: {measured.failure}")
        print(row(lib, label, [speed[lib][k] for k in KEYS] + [rss]))
    for lib in peers:
        if (lib == "llama.cpp") == quantised and lib in speed and "kvwire" in speed:
            print(f"{'  kvwire/' + lib:46}" + "".join(f"{speed['kvwire'][k] / speed[lib][k]:13.2f}" for k in KEYS))
    return footnotes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["float32", "bfloat16+int4", "float32+gguf", "float32+gguf+compile"])
    p.add_argument("--worker", nargs=2, metavar=("MODE", "VARIANT"))
    p.add_argument("--peers", nargs="*", default=[])
    p.add_argument("--probe", choices=list(PEERS))
    p.add_argument("--probe-variant", default="float32")
    args = p.parse_args()
    if args.worker or args.probe:
        result = probe(args.probe, args.probe_variant, args.threads) if args.probe else \
            worker(*args.worker, args.new_tokens, args.threads, args.peers)
        print(json.dumps(result))
        return
    print(header(args.threads), flush=True)
    common = ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    floats = [v for v in args.variants if parse_variant(v)["quantize"] is None]
    # llama.cpp runs the GGUF's own 4-bit weights whatever the variant; it is timed in every
    # run (interleaved with kvwire) and compared with the quantised variants
    wanted = (["transformers"] if floats else []) + ["llama.cpp"]
    probes = probe_peers(__file__, wanted, ["--probe-variant", (floats or ["float32"])[0], "--threads",
                                            str(args.threads)])
    failed = {peer: f"not timed: {r.failure} (probe: load + 2 tokens)" for peer, r in probes.items() if not r.ok}
    print(f"{'library':14}{'variant':32}" + "".join(f"{k:>13}" for k in KEYS) + f"{'peak RSS GB':>13}")
    later = []
    for variant in args.variants:
        quantised = parse_variant(variant)["quantize"] is not None
        these = ([] if quantised else ["transformers"]) + ["llama.cpp"]
        timed = [peer for peer in these if peer not in failed]
        result, note = with_fallback(
            lambda peers: run_worker(__file__, ["--worker", "speed", variant, *common, "--peers", *peers]), timed)
        why_not = dict(failed)
        if note:
            later.append(f"{variant}: {note}")
            why_not.update({peer: "not timed: the timed worker died with it (see below)" for peer in timed})
        if not result.ok:
            why_not["kvwire"] = f"not timed: {result.failure}"
        later += report(variant, these, result.value or {}, why_not, common)
    print("tokens/s; decode counts every row of the batch; best of 3 interleaved runs")
    for line in later:
        print(line)


if __name__ == "__main__":
    main()
