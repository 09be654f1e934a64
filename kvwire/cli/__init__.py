"""The `kvwire` command: generate, chat, serve (OpenAI API), score, evaluate on lm-evaluation-harness tasks
(`eval`), train control vectors (`steer train`), export, plot layer graphs, `info` (the CPU paths taken
here) and `cache prune`. One module per command, each with `add(commands)` registering its parser;
options.py holds what they share."""
import argparse
import sys

import torch

from . import cache, chat, eval, export, generate, info, plot, score, serve, steer
from .options import SAMPLERS, make_sampler, use_threads
from .steer import read_pairs

__all__ = ["SAMPLERS", "main", "make_sampler", "parser", "read_pairs"]


def parser():
    p = argparse.ArgumentParser(prog="kvwire", description="Editable causal language models whose KV cache "
                                "is a graph pass. Models: a preset name (gemma3-270m, the default, or "
                                "smollm2-135m-instruct), a GGUF file or a Hugging Face checkpoint folder.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, chat, serve, score, eval, steer, info, cache, export, plot):  # the order --help lists them in
        command.add(commands)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        use_threads(args)
        with torch.no_grad():  # restored on return: main(argv) called in a process leaves its grad mode as it was
            code = args.run(args)
    except (ValueError, TypeError, OSError, RuntimeError, FloatingPointError) as e:
        print(f"kvwire: error: {e}", file=sys.stderr)
        return 2
    return code or 0
