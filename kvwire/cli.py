"""The `kvwire` command: generate text, score text."""
import argparse
import sys

import torch

SAMPLERS = ("greedy", "random", "top-k", "top-p", "min-p", "beam")


def make_sampler(args):
    """The sampler object the command-line options describe."""
    from . import generate as g

    name = args.sampler
    if name is None:  # infer from the options given
        name = "beam" if args.beams else "top-p" if args.top_p is not None else "top-k" if args.top_k is not None \
            else "min-p" if args.min_p is not None else "random" if args.temperature is not None else "greedy"
    t = 1.0 if args.temperature is None else args.temperature
    return {
        "greedy": lambda: g.Greedy(),
        "random": lambda: g.Random(t),
        "top-k": lambda: g.TopK(50 if args.top_k is None else args.top_k, temperature=t),
        "top-p": lambda: g.TopP(0.9 if args.top_p is None else args.top_p, temperature=t),
        "min-p": lambda: g.MinP(0.1 if args.min_p is None else args.min_p, temperature=t),
        "beam": lambda: g.BeamSearch(num_beams=args.beams or 3),
    }[name]()


def _generate(args):
    from .load import load

    lm = load(args.model, dtype=args.dtype)
    options = dict(max_new_tokens=args.max_new_tokens, max_length=args.max_length, sampler=make_sampler(args),
                   seed=args.seed, stop=tuple(args.stop or ()), repetition_penalty=args.repetition_penalty)
    if args.no_stream or args.sampler == "beam" or args.beams:
        gen = lm.generate(args.prompt, return_logprobs=True, **options)
        print(args.prompt + gen.texts[0])
        _report(gen.prefill_seconds, len(gen.tokens[0]), gen.decode_steps, gen.decode_seconds)
        return
    print(args.prompt, end="", flush=True)
    gen = None
    for piece, gen in lm.stream_with_record(args.prompt, **options):
        print(piece, end="", flush=True)
    print()
    if gen is not None:
        _report(gen.prefill_seconds, len(gen.tokens[0]), gen.decode_steps, gen.decode_seconds)


def _report(prefill, new, steps, seconds):
    rate = steps / seconds if seconds > 0 else float("nan")
    print(f"prefill {prefill * 1000:.0f} ms, {new} new tokens, decode {rate:.1f} tokens/s", file=sys.stderr)


def _score(args):
    from .load import load

    lm = load(args.model, dtype=args.dtype)
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    logprobs = lm.score(text)
    print(f"{len(logprobs)} tokens, mean log-prob {float(logprobs.mean()):.4f}, "
          f"perplexity {float(torch.exp(-logprobs.mean())):.3f}")


def parser():
    p = argparse.ArgumentParser(prog="kvwire", description="Editable causal language models whose KV cache "
                                "is a graph pass. Models: a preset name (gemma3-270m, the default), a GGUF "
                                "file or a Hugging Face checkpoint folder.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = commands.add_parser("generate", help="continue a prompt (streams to the terminal)",
                            description="Continue a prompt. Streams text as it is produced; prefill time and "
                            "decode speed go to stderr.")
    g.add_argument("prompt", help="the text to continue")
    _model_options(g)
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N", help="tokens to generate (default 32)")
    g.add_argument("--max-length", type=int, default=None, metavar="N", help="prompt + new tokens at most")
    g.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="decoding method (default: greedy, or what the options below imply)")
    g.add_argument("--temperature", type=float, default=None, help="softmax temperature (> 0)")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass in (0, 1]")
    g.add_argument("--min-p", type=float, default=None, metavar="P", help="keep tokens >= P x the top probability")
    g.add_argument("--beams", type=int, default=None, metavar="N", help="beam search with N beams")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable; not printed)")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R", help="penalty > 0 on seen tokens")
    g.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    g.set_defaults(run=_generate)
    s = commands.add_parser("score", help="perplexity of a text file", description="Print the perplexity of a "
                            "UTF-8 text file under the model (one uncached pass).")
    s.add_argument("file", help="text file")
    _model_options(s)
    s.set_defaults(run=_score)
    return p


def _model_options(p):
    p.add_argument("--model", default="gemma3-270m", help="preset name, GGUF file or HF folder (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")


def main(argv=None):
    args = parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        args.run(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"kvwire: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
