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
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import load_variant, parse_variant, peak_rss_gb, run_worker, seconds  # noqa: E402

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
        plans[f"decode_b{batch}"] = (ids, lambda t1, tn, b=batch: b * (new_tokens - 1) / (tn - t1))
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
        for row in ids.tolist():  # llama-cpp-python generates one sequence at a time
            llm.reset()
            for count, _ in enumerate(llm.generate(row, temp=0.0), start=1):
                if count == n:
                    break
    return generate


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
            runners[peer] = transformers_runner(lm) if peer == "transformers" else llama_cpp_runner(threads)
        return measure(runners, lm.tokenizer.encode, new_tokens)
    # mode is a library name: its peak memory, alone in this process, over a 512-token prefill
    # and a few decode steps at batch 4
    encode = lm.tokenizer.encode
    generate = kvwire_runner(lm) if mode == "kvwire" else transformers_runner(lm)
    del lm
    generate(prompt_ids(encode, 512, 1), 2)
    generate(prompt_ids(encode, 16, 4), 8)
    return {"peak_rss_gb": peak_rss_gb()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["float32", "bfloat16+int4", "float32+gguf", "float32+gguf+compile"])
    p.add_argument("--worker", nargs=2, metavar=("MODE", "VARIANT"))
    p.add_argument("--peers", nargs="*", default=[])
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.new_tokens, args.threads, args.peers)))
        return
    llama = True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        llama = False
        print("llama-cpp-python is not installed: llama.cpp is not measured")
    common = ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    keys = ["decode_b1", "decode_b4", "prefill_32", "prefill_512"]
    print(f"{'library':14}{'variant':32}" + "".join(f"{k:>13}" for k in keys) + f"{'peak RSS GB':>13}")
    for variant in args.variants:
        quantised = parse_variant(variant)["quantize"] is not None
        # llama.cpp runs the GGUF's own 4-bit weights whatever the variant; it is timed in every
        # run (interleaved with kvwire) and compared with the quantised variants
        these = ([] if quantised else ["transformers"]) + (["llama.cpp"] if llama else [])
        speed = run_worker(__file__, ["--worker", "speed", variant, *common, "--peers", *these])
        for lib in ["kvwire", *these]:
            rss = run_worker(__file__, ["--worker", lib, variant, *common])["peak_rss_gb"] \
                if lib != "llama.cpp" else float("nan")
            label = "Q4_K_M" if lib == "llama.cpp" else variant
            print(f"{lib:14}{label:32}" + "".join(f"{speed[lib][k]:13.2f}" for k in keys) + f"{rss:13.2f}")
        for lib in these:
            if (lib == "llama.cpp") == quantised:
                print(f"{'  kvwire/' + lib:46}" + "".join(f"{speed['kvwire'][k] / speed[lib][k]:13.2f}" for k in keys))
    print("tokens/s; decode counts every row of the batch; best of 3 interleaved runs")


if __name__ == "__main__":
    main()
