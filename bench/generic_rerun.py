"""What the generic path's last resort costs: a model whose layers rerun over their kept inputs
against the same model with its key/value cache, in one run.

    python bench/generic_rerun.py [--threads 2] [--layers 8] [--width 512] [--new 24] [--prompts 16,256,1024]
                                  [--max-length 2048]

A random llama (transformers' own config and modules: `--layers` layers `--width` wide, float32)
through the generic path twice: with the key/value cache the pass finds, and made to rerun (the
cache checks refused, as they are for a model no cache route fits). Each decodes `--new` tokens
greedily at batch 1 after a prompt of each of `--prompts` tokens, in an engine whose cache holds
`--max-length` (run eagerly, the rerun's window is the row's history, not max_length), best of
two rounds. Prints ms a decoded token, rerun / cache, and the CPU. The tokens of the two must agree (the rerun is exact).

With `--llama4`, also a random Llama 4 text model at `bench/generic_mid.py`'s sizes (8 layers x
512, NoPE every fourth layer): only its NoPE layers rerunning (the build's choice: they read one
past length for the batch) against every layer made to rerun.
"""
import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

def model(layers, width, rerun):
    import transformers

    import kvwire as kw
    from kvwire.models.generic import build

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=width, intermediate_size=width * 3,
                                      num_hidden_layers=layers, num_attention_heads=width // 64,
                                      num_key_value_heads=max(1, width // 256), max_position_embeddings=4096)
    config._attn_implementation = "eager"
    import torch

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    checks = build._check_all_cached
    if rerun:
        def refuse(name, *args):
            raise ValueError(f"{name}: made to rerun by the benchmark")

        build._check_all_cached = refuse
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kw.from_hf(hf, generic=True)
    finally:
        build._check_all_cached = checks


def llama4(everything):
    """Llama 4 at generic_mid's sizes through the generic path: its NoPE layers rerunning, or all."""
    import kvwire as kw
    from generic_mid import mid_model
    from kvwire.models.generic import build

    some = build._rerun_some
    if everything:
        build._rerun_some = lambda *args: False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kw.from_hf(mid_model("llama4_text"), generic=True)
    finally:
        build._rerun_some = some


def decode_ms(lm, ids, new, length):
    """(ms a decoded token, tokens): an engine of `length` positions (the rerun's window) prefills
    `ids` then decodes `new` tokens; the time from the first token to the last, best of two rounds."""
    from kvwire.generate import Engine

    engine = Engine(lm, max_batch=1, max_length=length)
    best, tokens = float("inf"), None
    for _ in range(2):
        seq = engine.submit(ids[0].tolist(), new)
        start = None
        for _ in engine.run([seq]):
            if start is None and seq.tokens:
                start = time.perf_counter()
        best = min(best, (time.perf_counter() - start) / (len(seq.tokens) - 1))
        tokens = seq.tokens
    return 1000 * best, tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--prompts", default="16,256,1024")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--llama4", action="store_true", help="also Llama 4: its NoPE layers rerunning against all")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(header(args.threads))
    cached, rerun = model(args.layers, args.width, False), model(args.layers, args.width, True)
    assert cached.backbone.rerun_reason is None and rerun.backbone.rerun_reason is not None
    print(f"llama {args.layers} layers x {args.width}, float32, batch 1, {args.new} new tokens, "
          f"max_length {args.max_length}")
    compare(cached, rerun, ("cache", "rerun"), args)
    if not args.llama4:
        return
    some, every = llama4(False), llama4(True)
    count = len(every.backbone.layers)
    print(f"llama4_text {count} layers x 512, float32, batch 1: layers {some.backbone.rerun_layers} rerunning "
          f"against all {count}")
    compare(some, every, ("some", "all"), args)


def compare(first, second, names, args):
    """A row per prompt length: ms a decoded token of each model, second / first, same tokens."""
    import torch

    a_name, b_name = names
    print(f"{'prompt':>10} {a_name + ' ms/tok':>13} {b_name + ' ms/tok':>13} {b_name + ' / ' + a_name:>14} same tokens")
    for n in (int(n) for n in args.prompts.split(",")):
        ids = torch.randint(3, 4000, (1, n), generator=torch.Generator().manual_seed(n))
        a, tokens_a = decode_ms(first, ids, args.new, args.max_length)
        b, tokens_b = decode_ms(second, ids, args.new, args.max_length)
        print(f"{n:>10} {a:>13.2f} {b:>13.2f} {b / a:>13.1f}x {tokens_a == tokens_b}")


if __name__ == "__main__":
    main()
