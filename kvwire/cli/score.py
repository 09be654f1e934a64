"""`kvwire score`: the perplexity of a text file."""
import torch

from .options import load_model, model_options, quantize_option, steer_options


def add(commands):
    s = commands.add_parser("score", help="perplexity of a text file", description="Print the perplexity of a "
                            "UTF-8 text file under the model (one uncached pass).")
    s.add_argument("file", help="text file")
    model_options(s)
    quantize_option(s)
    steer_options(s)
    s.set_defaults(run=run)


def run(args):
    lm = load_model(args, args.quantize)
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    logprobs = lm.score(text)
    print(f"{len(logprobs)} tokens, mean log-prob {float(logprobs.mean()):.4f}, "
          f"perplexity {float(torch.exp(-logprobs.mean())):.3f}")
