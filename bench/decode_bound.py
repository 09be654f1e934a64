"""What bounds a batch-1 decode step on GGUF blocks: ggml's matmuls alone, streamed and in cache.

    python bench/decode_bound.py [--model smollm2-135m-instruct | gemma3-270m | FILE.gguf] [--threads 2]
                                 [--repeat 20]

Runs one decode step's matmuls of the preset (or GGUF file, say one of bench/size_scaling.py's) on
ggml's kernels (every `GGMLLinear` of `kw.load(model, quantize="gguf")`, one activation row each,
q/k/v and gate/up fused as generation runs them), with nothing else around them:
- streamed: each layer's own weights, as a step reads them (the file's blocks from memory);
- in cache: the first layer's weights for every layer (a working set of a few MB), the same calls;
- the head alone;
and how fast this machine streams memory (torch's sum over a 256 MB tensor), and llama.cpp's whole
decode step on the same file (timed from its tokens' arrival, in the same rounds). If "in cache" is not
much faster than "streamed" while memory streams far faster than the kernels read their blocks,
the kernels' arithmetic, not memory, bounds the step (as on a 2-core AMD EPYC, 2026-12-02: see
docs/performance.md).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402
from context import decode_rate, llama_cpp_stamps  # noqa: E402
from generate import TEXT, gguf_of  # noqa: E402


def decode_calls(lm):
    """[(x (1, in), [blocks], [qtypes])] per layer: one decode step's ggml calls (fused as generation
    fuses them: modules reading the same input go in one call), and the head's call."""
    import torch
    from kvwire.quant.ggml.linear import GGMLLinear

    groups, head = {}, None  # (layer, attention or MLP, output projection?) -> the modules reading one input
    for name, module in lm.named_modules():
        if isinstance(module, GGMLLinear) and name.split(".")[0] == "head":  # a tied head's blocks too
            head = module
        elif isinstance(module, GGMLLinear) and "embed" not in name:  # an untied embedding's blocks: rows read, no matmul
            parent, leaf = name.rsplit(".", 1)
            groups.setdefault((parent.rsplit(".", 1)[0], parent, leaf in ("o_proj", "down_proj")), []).append(module)
    layers = {}
    for (prefix, _, _), modules in groups.items():
        width = modules[0].in_features
        call = (torch.randn(1, width), [m.blocks for m in modules], [m.kernel_type for m in modules], width)
        layers.setdefault(prefix, []).append(call)
    head_call = None if head is None else (torch.randn(1, head.in_features), [head.blocks], [head.kernel_type],
                                           head.in_features)
    return list(layers.values()), head_call


def seconds_of(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(calls):
    import torch

    for x, blocks, qtypes, width in calls:
        torch.ops.kvwire.ggml_matmuls(x, blocks, qtypes, width)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="gemma3-270m, smollm2-135m-instruct or a GGUF file's path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if not os.path.isfile(args.model) and args.model not in ("gemma3-270m", "smollm2-135m-instruct"):
        parser.error(f"--model {args.model!r}: expected gemma3-270m, smollm2-135m-instruct or a GGUF file's path")
    import torch
    import kvwire as kw

    torch.set_num_threads(args.threads)
    print(header(args.threads))
    lm = kw.load(args.model, quantize="gguf", progress=False)
    layers, head = decode_calls(lm)
    streamed = [call for layer in layers for call in layer]
    in_cache = layers[0] * len(layers)
    size = lambda calls: sum(b.numel() for _, blocks, _, _ in calls for b in blocks) / 1e6  # noqa: E731
    print(f"model: {args.model}, {len(layers)} layers, {len(streamed)} layer calls a step "
          f"({size(streamed):.1f} MB of blocks){'' if head is None else f', head {size([head]):.1f} MB'}")
    # (label, job returning the seconds it measured, MB read or None)
    rows = [("layers, streamed", lambda: seconds_of(run, streamed), size(streamed)),
            (f"layers, in cache ({size(layers[0]):.1f} MB set)", lambda: seconds_of(run, in_cache), size(in_cache))]
    if head is not None:
        both = streamed + [head]
        rows += [("head", lambda: seconds_of(run, [head]), size([head])),
                 ("layers + head, streamed", lambda: seconds_of(run, both), size(both))]
    big = torch.ones(64 * 1024 * 1024)
    rows.append(("memory, torch sum of 256 MB", lambda: seconds_of(big.sum), big.numel() * 4 / 1e6))
    try:  # llama.cpp's whole step on the same file, 33 tokens after a 16-token prompt, same rounds
        path = args.model if os.path.isfile(args.model) else gguf_of(args.model, parser)[0]
        llama = llama_cpp_stamps(str(path), args.threads, 64)
        ids = lm.tokenizer.encode(TEXT)[:16]
        rows.append(("llama.cpp, a whole decode step", lambda: 1 / decode_rate(llama(ids, 33)), None))
    except ImportError as e:
        print(f"llama.cpp not timed: {e}")
    best = [float("inf")] * len(rows)
    for _ in range(args.repeat):  # interleaved, best of each: a noisy machine's drift hits all rows
        for i, (_, job, _) in enumerate(rows):
            best[i] = min(best[i], job())
    for (label, _, mb), seconds in zip(rows, best):
        rate = f"{mb / 1e3 / seconds:6.1f} GB/s" if mb is not None else ""
        print(f"{label:34} {seconds * 1e3:7.2f} ms  {rate}")
    labels = [label for label, _, _ in rows]
    if labels[-1].startswith("llama.cpp") and head is not None:
        floor = best[labels.index("layers + head, streamed")]
        print(f"llama.cpp's step / the matmuls alone: {best[-1] / floor:.2f}x, the most any code around "
              f"these kernels could gain over llama.cpp")

if __name__ == "__main__":
    main()
