"""`kvwire chat`: an interactive, multi-turn chat on the terminal."""
import sys

from ..generate import BeamSearch
from .options import (chat_template_option, echo, load_model, model_options, quantize_option, sampling_options,
                      steer_options, make_sampler)


def add(commands):
    c = commands.add_parser("chat", help="chat with a chat model on the terminal",
                            description="Interactive multi-turn chat with the model's own chat template. Replies "
                            "stream as they are produced; each turn reuses the conversation's cached keys/values. "
                            "/reset clears the conversation, /exit or end of input quits.")
    model_options(c)
    chat_template_option(c)
    quantize_option(c)
    sampling_options(c, max_new_tokens=256)
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation")
    steer_options(c)
    c.set_defaults(run=run)


def run(args):
    """An interactive, multi-turn chat on the terminal; each reply streams as it is produced and
    the conversation's keys/values are reused by the next turn (lm.chat's prefix store)."""
    sampler = make_sampler(args)
    if isinstance(sampler, BeamSearch):
        raise ValueError("kvwire chat samples (greedy, top-p, ...); beam search runs through kvwire generate")
    lm = load_model(args, args.quantize)
    if lm.tokenizer is None or lm.tokenizer.chat_template is None:
        raise ValueError(f"{args.model} has no chat template, so kvwire chat cannot render a conversation for it; "
                         f"use kvwire generate, or a chat model (--model smollm2-135m-instruct)")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    options = dict(max_new_tokens=args.max_new_tokens, max_length=args.max_length or lm.max_context,
                   sampler=sampler, seed=args.seed, stop=tuple(args.stop or ()),
                   repetition_penalty=args.repetition_penalty)
    interactive = sys.stdin.isatty()
    if interactive:
        print("kvwire chat: /reset clears the conversation, /exit (or Ctrl-D) quits", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave cleanly, not with a traceback
            print("\n(bye)", file=sys.stderr)
            break
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            messages = list(start)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        pieces = []
        try:
            for piece in echo(lm.chat(messages, stream=True, **options)):
                pieces.append(piece)
        except ValueError as e:  # the conversation outgrew the context, the template refused it, ...
            messages.pop()
            print(f"\nkvwire: error: {e} (/reset starts over)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C during a reply: stop it, keep what was shown and the conversation
            print("\n(reply stopped)", file=sys.stderr, end="")
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(pieces)})
