"""Decode speed as the context grows: kvwire vs llama.cpp on the same GGUF file, batch 1.

    python bench/context.py [--model gemma3-270m | smollm2-135m-instruct] [--contexts 16 256 960]
                            [--new-tokens 33] [--threads 2] [--repeat 3] [--variants float32+gguf+compile]

bench/generate.py decodes after a 16-token prompt; here each prompt is `context` tokens long, so
every step attends over that many keys (kvwire's compiled step over its cache bucket, 64 x 2^k
slots; llama.cpp over the filled positions of its float16 cache). A step's time is taken from the
tokens' own arrival: tokens / time between the first token's arrival and the last's, so the
prefill is not in it. Libraries are timed in turn inside each repetition (best kept), in one
process. Variants as in bench/generate.py ("float32+gguf+compile" = `kw.load(quantize="gguf")`
then `lm.compile()`).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header, load_variant  # noqa: E402
from generate import TEXT, gguf_of  # noqa: E402


def decode_rate(stamps):
    """Tokens/s from [(tokens so far, arrival time in s)]: between the first and the last arrival."""
    (first, start), (last, end) = stamps[0], stamps[-1]
    if last <= first or end <= start:
        raise ValueError(f"need arrivals with more tokens at a later time, got {stamps[0]} .. {stamps[-1]}")
    return (last - first) / (end - start)


def kvwire_stamps(lm):
    """run(ids, n) -> [(tokens so far, time)] as kvwire streams n tokens after the prompt `ids`."""
    def run(ids, n):
        prompt = lm.tokenizer.decode(ids)  # stream takes text (main checks it encodes to these ids)
        stamps = [(len(record.tokens[0]), time.perf_counter()) for _, record in
                  lm.stream_with_record(prompt, max_new_tokens=n, ignore_eos=True, logprobs=False)]
        assert stamps[-1][0] == n, f"kvwire streamed {stamps[-1][0]} tokens, not {n}"
        return stamps
    return run


def llama_cpp_stamps(gguf, threads, n_ctx):
    from llama_cpp import Llama

    llm = Llama(gguf, n_threads=threads, n_ctx=n_ctx, verbose=False)

    def run(ids, n):
        llm.reset()
        stamps = []
        for count, _ in enumerate(llm.generate(ids, temp=0.0), start=1):
            stamps.append((count, time.perf_counter()))
            if count == n:
                return stamps
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m", choices=["gemma3-270m", "smollm2-135m-instruct"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 256, 960])
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["float32+gguf+compile"])
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(header(args.threads))
    gguf, file_type = gguf_of(args.model, parser)
    n_ctx = max(args.contexts) + args.new_tokens
    runners = {}
    for variant in args.variants:
        lm = load_variant(variant, args.model)
        runners[f"kvwire {variant}"] = kvwire_stamps(lm)
    try:
        runners["llama.cpp (file's blocks)"] = llama_cpp_stamps(str(gguf), args.threads, n_ctx)
    except ImportError as e:
        print(f"llama.cpp not timed: {e}")
    ids = lm.tokenizer.encode(TEXT)
    if len(ids) < max(args.contexts):
        raise SystemExit(f"the bench text has {len(ids)} tokens; contexts go up to {max(args.contexts)}")
    for context in args.contexts:  # kvwire streams text: its prompt must be llama.cpp's ids
        if lm.tokenizer.encode(lm.tokenizer.decode(ids[:context])) != ids[:context]:
            raise SystemExit(f"the first {context} tokens do not survive decode + encode; pick another length")
    print(f"model: {args.model} ({os.path.basename(str(gguf))}, {file_type}); decode tokens/s at batch 1, "
          f"{args.new_tokens} new tokens after a prompt of each length; best of {args.repeat}")
    best = {name: {c: 0.0 for c in args.contexts} for name in runners}
    for context in args.contexts:
        for run in runners.values():  # warm up: compiles the cache bucket the timed runs use
            run(ids[:context], args.new_tokens)
    for _ in range(args.repeat):
        for context in args.contexts:
            for name, run in runners.items():
                rate = decode_rate(run(ids[:context], args.new_tokens))
                best[name][context] = max(best[name][context], rate)
    print(f"{'library':46}" + "".join(f"{f'ctx {c}':>12}" for c in args.contexts))
    for name, rates in best.items():
        print(f"{name:46}" + "".join(f"{rates[c]:12.2f}" for c in args.contexts))
    peer = best.get("llama.cpp (file's blocks)")
    if peer:
        for name, rates in best.items():
            if name.startswith("kvwire"):
                print(f"{name + ' / llama.cpp':46}" + "".join(f"{rates[c] / peer[c]:12.2f}" for c in args.contexts))


if __name__ == "__main__":
    main()
