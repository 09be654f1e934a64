"""Generation speed of the default model: kvwire vs transformers `generate` on the same weights.

    python bench/generate.py [--new-tokens 32] [--threads 2] [--dtypes float32 bfloat16]

transformers gets kvwire's own Gemma 3 270M weights (same names but the `model.` prefix), so no
GGUF load is needed and both run the same numbers in the same dtype. Each library and dtype runs
in its own subprocess (peak RSS is per process). llama.cpp is measured too when llama-cpp-python
is installed. Prints decode tokens/s at batch 1 and 4, prefill tokens/s for 32- and 512-token
prompts, peak RSS, and the kvwire / peer ratios.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import peak_rss_gb, run_worker, seconds  # noqa: E402

TEXT = ("The history of the city of Paris begins with a small settlement on an island in the river Seine. "
        "Over two thousand years it grew into one of the great capitals of the world, ") * 40


def prompt_ids(tokenizer_encode, length, batch):
    ids = tokenizer_encode(TEXT)[:length]
    assert len(ids) == length
    import torch

    rows = torch.tensor(ids)[None].repeat(batch, 1)
    rows[:, 1:] = (rows[:, 1:] + torch.arange(batch)[:, None]) % 20_000 + 3  # distinct rows, same length
    return rows


def measure(generate, encode, new_tokens):
    """generate(ids (B, T), n) runs n new tokens with no early stop."""
    result = {}
    for batch in (1, 4):
        ids = prompt_ids(encode, 16, batch)
        generate(ids, 2)
        one = seconds(lambda: generate(ids, 1), repeat=3)  # best of n: this machine is noisy
        full = seconds(lambda: generate(ids, new_tokens), repeat=2)
        result[f"decode_b{batch}"] = batch * (new_tokens - 1) / (full - one)
    for length in (32, 512):
        ids = prompt_ids(encode, length, 1)
        result[f"prefill_{length}"] = length / seconds(lambda: generate(ids, 1), repeat=3)
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def worker(library, dtype, new_tokens, threads):
    import torch

    import kvwire as kw

    torch.set_num_threads(threads)
    lm = kw.load("gemma3-270m", dtype=dtype, progress=False)
    encode = lm.tokenizer.encode
    if library == "kvwire":
        def generate(ids, n):
            out = lm.generate(ids, max_new_tokens=n, ignore_eos=True)
            assert all(len(o) == n for o in out)
        return measure(generate, encode, new_tokens)
    if library == "transformers":
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
        model = model.to_empty(device="cpu") if any(p.is_meta for p in model.parameters()) else model
        model.model.rotary_emb.__init__(hf_config)  # buffers built on meta
        model.model.embed_tokens.embed_scale = torch.tensor(c.hidden_size**0.5)
        model.eval()
        del lm

        def generate(ids, n):
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     attention_mask=torch.ones_like(ids), pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + n
        return measure(generate, encode, new_tokens)
    if library == "llama.cpp":
        from llama_cpp import Llama

        from kvwire.models.gemma3.presets import gemma3_270m

        llm = Llama(gemma3_270m(), n_threads=threads, n_ctx=1024, verbose=False)

        def generate(ids, n):
            for row in ids.tolist():  # llama-cpp-python generates one sequence at a time
                llm.reset()
                count = 0
                for _ in llm.generate(row, temp=0.0):
                    count += 1
                    if count == n:
                        break
        return measure(generate, encode, new_tokens)
    raise ValueError(library)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--worker", nargs=2, metavar=("LIBRARY", "DTYPE"))
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.new_tokens, args.threads)))
        return
    try:
        import llama_cpp  # noqa: F401
        peers = ["transformers", "llama.cpp"]
    except ImportError:
        peers = ["transformers"]
        print("llama-cpp-python is not installed: llama.cpp is not measured")
    common = ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    rows = []
    for dtype in args.dtypes:
        ours = run_worker(__file__, ["--worker", "kvwire", dtype, *common])
        rows.append(("kvwire", dtype, ours, None))
        for peer in peers:
            if peer == "llama.cpp" and dtype != args.dtypes[0]:
                continue  # llama.cpp runs the GGUF's own quantised weights, whatever our dtype
            theirs = run_worker(__file__, ["--worker", peer, dtype, *common])
            rows.append((peer, dtype, theirs, ours))
    keys = ["decode_b1", "decode_b4", "prefill_32", "prefill_512", "peak_rss_gb"]
    print(f"{'library':14}{'dtype':10}" + "".join(f"{k:>14}" for k in keys))
    for name, dtype, r, ours in rows:
        print(f"{name:14}{dtype:10}" + "".join(f"{r[k]:14.2f}" for k in keys))
        if ours is not None:
            ratios = "".join(f"{ours[k] / r[k]:14.2f}" for k in keys[:-1])
            print(f"{'  kvwire/' + name[:5]:24}{ratios}")
    print("units: tokens/s (decode counts all rows of the batch), GB")


if __name__ == "__main__":
    main()
