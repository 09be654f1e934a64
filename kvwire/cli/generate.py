"""`kvwire generate`: continue a prompt, streaming to the terminal."""
import torch

from ..generate import BeamSearch
from .options import (load_model, model_options, quantize_option, report, sampling_options, steer_options,
                      make_sampler)


def add(commands):
    g = commands.add_parser("generate", help="continue a prompt (streams to the terminal)",
                            description="Continue a prompt. Streams text as it is produced; prefill time and "
                            "decode speed go to stderr.")
    g.add_argument("prompt", help="the text to continue")
    model_options(g)
    quantize_option(g)
    g.add_argument("--compile", action="store_true",
                   help="compile the decode step and short prompts (a minute or two the first time; later runs load "
                        "the compiled steps kept in the cache folder in about a second; pays with --quantize gguf)")
    sampling_options(g)
    g.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    g.add_argument("--runtime", default="eager", choices=["eager", "onnx", "executorch"],
                   help="eager (kvwire), or onnx / executorch: --model is then an exported .onnx / .pte file")
    steer_options(g)
    g.set_defaults(run=run)


def run(args):
    sampler = make_sampler(args)  # refuse contradicting options before loading anything
    lm = load_model(args, args.quantize)
    if args.compile:
        if args.runtime != "eager":
            raise ValueError(f"--compile applies to eager models; --runtime {args.runtime} runs its own program")
        # kept on disk (ahead of time, the CPU's default), the prompt's graph is built once for every later
        # call; traced anew in each process (other devices), it would cost more than it saves
        lm.compile(prefill_tokens=32 if lm.device.type == "cpu" else 0)
    options = dict(max_new_tokens=args.max_new_tokens, max_length=args.max_length, sampler=sampler,
                   seed=args.seed, stop=tuple(args.stop or ()), repetition_penalty=args.repetition_penalty)
    if args.runtime != "eager" and args.strength is not None and "steer_strength" in lm.cached.runtime_inputs:
        options["inputs"] = {"steer_strength": torch.tensor([args.strength])}
    if args.no_stream or isinstance(options["sampler"], BeamSearch):
        gen = lm.generate(args.prompt, return_logprobs=True, **options)
        print(args.prompt + gen.texts[0])
        report(gen.prefill_seconds, len(gen.tokens[0]), gen.decode_steps, gen.decode_seconds)
        return
    pieces = lm.stream_with_record(args.prompt, logprobs=False, **options)  # checks the options first
    print(args.prompt, end="", flush=True)
    gen = None
    for piece, gen in pieces:  # the record for its timings only
        print(piece, end="", flush=True)
    print()
    if gen is not None:
        report(gen.prefill_seconds, len(gen.tokens[0]), gen.decode_steps, gen.decode_seconds)
