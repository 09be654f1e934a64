"""The `kvwire` command."""
import argparse
import sys

import torch


def _generate(args):
    from .load import load

    lm = load(args.model, dtype=args.dtype)
    result = lm.generate_ids(args.prompt, max_new_tokens=args.max_new_tokens, max_length=args.max_length)
    print(args.prompt + lm.tokenizer.decode(result.tokens[0]))
    new = len(result.tokens[0])
    print(f"prefill {result.prefill_seconds * 1000:.0f} ms, {new} new tokens, "
          f"decode {result.decode_tokens_per_second:.1f} tokens/s", file=sys.stderr)


def parser():
    p = argparse.ArgumentParser(prog="kvwire", description="Editable causal LMs with a cached layer graph.")
    commands = p.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="greedy continuation of a prompt")
    g.add_argument("prompt", help="the text to continue")
    g.add_argument("--model", default="gemma3-270m", help="preset name, GGUF file or HF folder (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 32)")
    g.add_argument("--max-length", type=int, default=None, help="prompt + new tokens at most")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.set_defaults(run=_generate)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        args.run(args)
    except (ValueError, TypeError) as e:
        print(f"kvwire: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
