"""The `kvwire` command: generate, chat, serve (OpenAI API), score, train control vectors (`steer train`),
export, plot layer graphs, and `info` (the CPU paths taken here)."""
import argparse
import sys

import torch

from . import info
from .generate import BeamSearch
from .quant import SCHEMES

SAMPLERS = ("greedy", "random", "top-k", "top-p", "min-p", "beam")


# the option each sampler reads; an option of another sampler would be dropped silently
_OPTION_OF = {"top-k": "top_k", "top-p": "top_p", "min-p": "min_p", "beam": "beams"}


def make_sampler(args):
    """The sampler object the command-line options describe. kvwire's samplers are one filter
    each, so options of two samplers (--top-k with --top-p, --sampler random with --top-k) are
    refused rather than one being dropped."""
    from . import generate as g

    given = [name for name, option in _OPTION_OF.items() if getattr(args, option) is not None]
    flags = ", ".join("--" + _OPTION_OF[n].replace("_", "-") for n in given)
    if len(given) > 1:
        raise ValueError(f"{flags} belong to different samplers and cannot be combined here; give one of them")
    name = args.sampler
    if name is None:  # infer from the options given
        name = given[0] if given else "random" if args.temperature is not None else "greedy"
    elif given and given[0] != name:
        raise ValueError(f"--sampler {name} does not use {flags}; drop it or use --sampler {given[0]}")
    if args.temperature is not None and name in ("greedy", "beam"):
        raise ValueError(f"--sampler {name} is deterministic and takes no --temperature")
    t = 1.0 if args.temperature is None else args.temperature
    return {
        "greedy": lambda: g.Greedy(),
        "random": lambda: g.Random(t),
        "top-k": lambda: g.TopK(50 if args.top_k is None else args.top_k, temperature=t),
        "top-p": lambda: g.TopP(0.9 if args.top_p is None else args.top_p, temperature=t),
        "min-p": lambda: g.MinP(0.1 if args.min_p is None else args.min_p, temperature=t),
        "beam": lambda: g.BeamSearch(num_beams=3 if args.beams is None else args.beams),
    }[name]()


def _load_model(args, quantize=None):
    """The model the options name (quantised when asked), steered by --control-vector when given."""
    from .load import load
    from .steer import ControlVector

    if getattr(args, "runtime", "eager") != "eager":
        from .export import load_exported
        if getattr(args, "control_vector", None):
            raise ValueError("--control-vector applies to eager models; export a steered model instead "
                             "(kvwire export --control-vector V ...) and pass --strength at run time")
        if quantize or getattr(args, "head", None):
            raise ValueError(f"--quantize and --head apply to eager models; --runtime {args.runtime} runs the "
                             "file's own weights (export with kvwire export --quantize for ONNX)")
        return load_exported(args.model)
    lm = load(args.model, dtype=args.dtype, quantize=quantize, head=getattr(args, "head", None))
    if getattr(args, "control_vector", None):
        strength = 1.0 if args.strength is None else args.strength
        lm = lm.steer(ControlVector.load(args.control_vector), strength,
                      generated_only=getattr(args, "generated_only", False))
    return lm


def _generate(args):
    sampler = make_sampler(args)  # refuse contradicting options before loading anything
    lm = _load_model(args, args.quantize)
    if args.compile:
        if args.runtime != "eager":
            raise ValueError(f"--compile applies to eager models; --runtime {args.runtime} runs its own program")
        lm.compile(prefill_tokens=0)  # one prompt a process: a prompt graph costs more to compile than it saves
    options = dict(max_new_tokens=args.max_new_tokens, max_length=args.max_length, sampler=sampler,
                   seed=args.seed, stop=tuple(args.stop or ()), repetition_penalty=args.repetition_penalty)
    if args.runtime != "eager" and args.strength is not None and "steer_strength" in lm.cached.runtime_inputs:
        options["inputs"] = {"steer_strength": torch.tensor([args.strength])}
    if args.no_stream or isinstance(options["sampler"], BeamSearch):
        gen = lm.generate(args.prompt, return_logprobs=True, **options)
        print(args.prompt + gen.texts[0])
        _report(gen.prefill_seconds, len(gen.tokens[0]), gen.decode_steps, gen.decode_seconds)
        return
    pieces = lm.stream_with_record(args.prompt, logprobs=False, **options)  # checks the options first
    print(args.prompt, end="", flush=True)
    gen = None
    for piece, gen in pieces:  # the record for its timings only
        print(piece, end="", flush=True)
    print()
    if gen is not None:
        _report(gen.prefill_seconds, len(gen.tokens[0]), gen.decode_steps, gen.decode_seconds)


def _report(prefill, new, steps, seconds):
    rate = steps / seconds if seconds > 0 else float("nan")
    print(f"prefill {prefill * 1000:.0f} ms, {new} new tokens, decode {rate:.1f} tokens/s", file=sys.stderr)


def _chat(args):
    """An interactive, multi-turn chat on the terminal; each reply streams as it is produced and
    the conversation's keys/values are reused by the next turn (lm.chat's prefix store)."""
    sampler = make_sampler(args)
    if isinstance(sampler, BeamSearch):
        raise ValueError("kvwire chat samples (greedy, top-p, ...); beam search runs through kvwire generate")
    lm = _load_model(args, args.quantize)
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
        try:
            reply = "".join(_echo(lm.chat(messages, stream=True, **options)))
        except ValueError as e:  # the conversation outgrew the context, the template refused it, ...
            messages.pop()
            print(f"\nkvwire: error: {e} (/reset starts over)", file=sys.stderr)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def _echo(pieces):
    for piece in pieces:
        print(piece, end="", flush=True)
        yield piece


def _serve(args):
    import logging

    from .serve import create_app, serve
    from .steer import ControlVector

    named = _named_files(args.control_vector or [])  # refuse bad NAME=FILE before loading anything
    vectors = {name: ControlVector.load(path) for name, path in named.items()}
    lm = _load_model(argparse.Namespace(**{**vars(args), "control_vector": None}), args.quantize)
    app = create_app(lm, args.model, max_batch=args.max_batch, max_length=args.max_length, control_vectors=vectors)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1 (control vectors: "
          f"{', '.join(vectors) or 'none'}); playground: http://{args.host}:{args.port}/", file=sys.stderr)
    serve(app, host=args.host, port=args.port)


def _named_files(pairs):
    """--control-vector NAME=FILE options as {name: file}."""
    from .serve.options import check_names

    named = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--control-vector {pair!r}: expected NAME=FILE, e.g. happy=happy.gguf")
        if name in named:
            raise ValueError(f"--control-vector name {name!r} is given twice; each name steers with one vector")
        named[name] = path
    check_names(named)
    return named


def _score(args):
    lm = _load_model(args, args.quantize)
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    logprobs = lm.score(text)
    print(f"{len(logprobs)} tokens, mean log-prob {float(logprobs.mean()):.4f}, "
          f"perplexity {float(torch.exp(-logprobs.mean())):.3f}")


def _export(args):
    from .export import export

    lm = _load_model(args)
    report = export(lm, args.output, max_length=args.max_length, batch_size=args.batch_size, format=args.format,
                    overwrite=args.overwrite, quantize=args.quantize, delegate=args.delegate,
                    prefill_length=tuple(args.prefill_length) if args.prefill_length else None)
    print(f"wrote {report['path']} ({report['format']}, {report['bytes'] / 1e6:.1f} MB) in "
          f"{report['seconds']:.1f} s", file=sys.stderr)


def read_pairs(positive_path, negative_path):
    """Line i of one file pairs with line i of the other; pairs where both lines are blank are
    dropped together (so blank lines never shift the pairing); a blank line facing text, or files
    with different numbers of prompts, are refused with the line number."""
    files = []
    for path in (positive_path, negative_path):
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
        while lines and not lines[-1].strip():  # trailing blank lines
            lines.pop()
        files.append(lines)
    (pos, neg), (pos_path, neg_path) = files, (positive_path, negative_path)
    if len(pos) != len(neg):
        raise ValueError(f"{pos_path} has {len(pos)} lines and {neg_path} has {len(neg)}; line i of one pairs "
                         f"with line i of the other")
    pairs = []
    for number, (p, n) in enumerate(zip(pos, neg), start=1):
        if not p.strip() and not n.strip():
            continue
        if not p.strip() or not n.strip():
            blank, other = (pos_path, neg_path) if not p.strip() else (neg_path, pos_path)
            raise ValueError(f"line {number} is blank in {blank} but not in {other}; pairs must line up")
        pairs.append((p, n))
    if not pairs:
        raise ValueError(f"{pos_path} and {neg_path} hold no prompt pairs")
    return [p for p, _ in pairs], [n for _, n in pairs]


def _steer_train(args):
    from .load import load
    from .steer import ControlVector

    positive, negative = read_pairs(args.positive, args.negative)
    lm = load(args.model, dtype=args.dtype)
    vec = ControlVector.train(lm, positive, negative, layers=args.layers, method=args.method,
                              batch_size=args.batch_size)
    vec.save(args.output)
    print(f"wrote {args.output}: {len(vec.layers)} directions (blocks {vec.layers[0]}-{vec.layers[-1]}), "
          f"width {vec.width}, method {vec.method}", file=sys.stderr)


def _steer_sweep(args):
    import json

    from .load import load
    from .steer import ControlVector, WordGap, sweep

    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise ValueError(f"--plot must name a .png, .svg or .pdf file, got {args.plot!r}")
    probe = WordGap(*(args.positive_words, args.negative_words) if args.positive_words or args.negative_words
                    else (), **({"prompts": args.probe_prompt} if args.probe_prompt else {}))
    vector = ControlVector.load(args.control_vector)
    lm = load(args.model, dtype=args.dtype)
    result = sweep(lm, vector, args.strengths, probe=probe, prompt=args.prompt, max_new_tokens=args.max_new_tokens)
    print(result)
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)


def _plot(args):
    from .graph import plot

    lm = _load_model(args)
    plot(lm.cached if args.cached else lm.backbone, args.output, depth=args.depth)
    print(f"wrote {args.output}", file=sys.stderr)


def parser():
    p = argparse.ArgumentParser(prog="kvwire", description="Editable causal language models whose KV cache "
                                "is a graph pass. Models: a preset name (gemma3-270m, the default, or "
                                "smollm2-135m-instruct), a GGUF file or a Hugging Face checkpoint folder.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = commands.add_parser("generate", help="continue a prompt (streams to the terminal)",
                            description="Continue a prompt. Streams text as it is produced; prefill time and "
                            "decode speed go to stderr.")
    g.add_argument("prompt", help="the text to continue")
    _model_options(g)
    _quantize_option(g)
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (about a minute first; pays with --quantize gguf)")
    _sampling_options(g)
    g.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    g.add_argument("--runtime", default="eager", choices=["eager", "onnx", "executorch"],
                   help="eager (kvwire), or onnx / executorch: --model is then an exported .onnx / .pte file")
    _steer_options(g)
    g.set_defaults(run=_generate)
    _chat_and_serve_parsers(commands)
    s = commands.add_parser("score", help="perplexity of a text file", description="Print the perplexity of a "
                            "UTF-8 text file under the model (one uncached pass).")
    s.add_argument("file", help="text file")
    _model_options(s)
    _quantize_option(s)
    _steer_options(s)
    s.set_defaults(run=_score)
    _steer_parser(commands)
    i = commands.add_parser("info", help="this machine's CPU features and the kernel paths kvwire takes",
                            description="Print kvwire's and torch's versions, the CPU's features, the bfloat16 "
                            "GEMM path and ggml kernel chosen from them (and the variables overriding them), "
                            "devices, optional packages and the cache. Exits 1 if a setting is invalid.")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(run=lambda args: info.main(args.json))
    e = commands.add_parser("export", help="export the (steered) model's cached graph to a file",
                            description="Export the cached graph plus head as one model: .onnx, .pte "
                            "(ExecuTorch) or .mlpackage (Core ML). Run .onnx / .pte files with kvwire generate "
                            "--runtime onnx|executorch --model FILE.")
    e.add_argument("output", help="output file, e.g. model.onnx")
    _model_options(e)
    _steer_options(e)
    e.add_argument("--max-length", type=int, default=None, metavar="N", help="cache length (default 1024)")
    e.add_argument("--format", default=None, choices=["onnx", "executorch", "coreml"], help="when the suffix is unclear")
    e.add_argument("--quantize", default=None, choices=SCHEMES, help="ONNX weight-only quantisation")
    e.add_argument("--batch-size", type=int, default=1, metavar="N", help="rows per call (ExecuTorch, Core ML)")
    e.add_argument("--delegate", default="xnnpack", choices=["xnnpack", "portable"], help="ExecuTorch kernels")
    e.add_argument("--prefill-length", type=int, nargs="+", default=None, metavar="N",
                   help="static prefill chunk length(s) besides the decode step (ExecuTorch: default 64 8; "
                        "Core ML: one, default 64)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing file")
    e.set_defaults(run=_export)
    pl = commands.add_parser("plot", help="draw the layer graph (svg/png/pdf/dot)",
                             description="Draw the model's layer graph with Graphviz. Inserted layers are "
                             "orange; with --cached, the cache inputs and outputs of every layer are drawn.")
    pl.add_argument("output", help="output file: .svg, .png, .pdf or .dot")
    _model_options(pl)
    _steer_options(pl)
    pl.add_argument("--cached", action="store_true", help="draw the cached graph (layer depth, cache wiring)")
    pl.add_argument("--depth", choices=["block", "layer"], default="block", help="granularity (default: block)")
    pl.set_defaults(run=_plot)
    return p


def _sampling_options(p, max_new_tokens=None):
    shown = 32 if max_new_tokens is None else max_new_tokens  # None: generate's own default
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help=f"tokens to generate (default {shown})")
    p.add_argument("--max-length", type=int, default=None, metavar="N", help="prompt + new tokens at most")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="decoding method (default: greedy, or what the options below imply)")
    p.add_argument("--temperature", type=float, default=None, help="softmax temperature (> 0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--min-p", type=float, default=None, metavar="P", help="keep tokens >= P x the top probability")
    p.add_argument("--beams", type=int, default=None, metavar="N", help="beam search with N beams")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable; not printed)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R", help="penalty > 0 on seen tokens")


def _chat_and_serve_parsers(commands):
    c = commands.add_parser("chat", help="chat with a chat model on the terminal",
                            description="Interactive multi-turn chat with the model's own chat template. Replies "
                            "stream as they are produced; each turn reuses the conversation's cached keys/values. "
                            "/reset clears the conversation, /exit or end of input quits.")
    _model_options(c)
    _quantize_option(c)
    _sampling_options(c, max_new_tokens=256)
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation")
    _steer_options(c)
    c.set_defaults(run=_chat)
    s = commands.add_parser("serve", help="serve the model over OpenAI's HTTP API",
                            description="An OpenAI-compatible server: POST /v1/chat/completions, /v1/completions, "
                            "GET /v1/models, /health. Requests choose control-vector strengths with "
                            "\"steer\": {NAME: strength} (absent names: 0).")
    _model_options(s)
    _quantize_option(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument("--control-vector", action="append", default=None, metavar="NAME=FILE",
                   help="a control vector requests may steer with as \"steer\": {NAME: strength} (repeatable)")
    s.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences decoding at once (default 8); "
                   "more requests wait")
    s.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="prompt + completion per request (default: the model's context, at most 4096)")
    s.set_defaults(run=_serve)


def _steer_parser(commands):
    st = commands.add_parser("steer", help="control vectors: `steer train`, `steer sweep`")
    actions = st.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = actions.add_parser("train", help="train a control vector from contrastive prompts",
                           description="Train a control vector from paired prompts (one per line; line i of "
                           "--positive pairs with line i of --negative) and write llama.cpp's GGUF format.")
    t.add_argument("--positive", required=True, metavar="FILE", help="prompts showing the concept")
    t.add_argument("--negative", required=True, metavar="FILE", help="paired prompts showing its opposite")
    t.add_argument("--layers", default=None, metavar="A-B", help="blocks to steer (default: 1 to the last)")
    t.add_argument("--method", default="pca_center", choices=["pca_center", "pca_diff", "mean_diff"])
    t.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts per forward (default 8)")
    t.add_argument("-o", "--output", required=True, metavar="VEC.gguf", help="where to write the vector")
    _model_options(t)
    t.set_defaults(run=_steer_train)
    w = actions.add_parser("sweep", help="a probe and a sample per strength (optionally plotted)",
                           description="Steer with a control vector at each strength; print the probe (mean "
                           "log-probability of the positive words minus the negative words as the next token "
                           "after neutral prompts; default happy vs sad words) and a greedy sample.")
    w.add_argument("--control-vector", required=True, metavar="VEC.gguf", help="the vector to sweep")
    w.add_argument("--strengths", type=float, nargs="+", default=[-1.0, -0.5, 0.0, 0.5, 1.0], metavar="S",
                   help="strengths (default: -1 -0.5 0 0.5 1)")
    w.add_argument("--prompt", default="I think that today is", help="the samples' prompt")
    w.add_argument("--max-new-tokens", type=int, default=24, metavar="N", help="tokens per sample (default 24)")
    w.add_argument("--positive-words", nargs="+", default=None, metavar="W",
                   help="words the vector should make likelier (give the leading space: ' happy')")
    w.add_argument("--negative-words", nargs="+", default=None, metavar="W", help="words it should make rarer")
    w.add_argument("--probe-prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt the probe reads the next word after (repeatable; default: five neutral ones)")
    w.add_argument("--plot", default=None, metavar="SWEEP.png", help="draw probe vs strength and the samples")
    w.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    _model_options(w)
    w.set_defaults(run=_steer_sweep)


def _steer_options(p):
    p.add_argument("--control-vector", default=None, metavar="VEC.gguf", help="steer with this control vector")
    p.add_argument("--strength", type=float, default=None,
                   help="control-vector strength (default 1.0; for --runtime onnx: the exported default)")
    p.add_argument("--generated-only", action="store_true", help="steer generated tokens only, not the prompt")


def _quantize_option(p):
    p.add_argument("--quantize", default=None, metavar="Q",
                   help="weights of the eager model: 'gguf' (a GGUF file's own quantised blocks on ggml's "
                        f"kernels), a ggml type (q8_0, q5_0, q4_k, ...) or {' / '.join(SCHEMES)} (PyTorch kernels)")
    p.add_argument("--head", default=None, metavar="Q",
                   help="with --quantize gguf: re-quantise the logits head to ggml type Q (q5_0: a smaller head, "
                        "most of a decode step's bytes) straight from the file's blocks")


def _model_options(p):
    p.add_argument("--model", default="gemma3-270m", help="preset name, GGUF file or HF folder (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        with torch.no_grad():  # restored on return: main(argv) called in a process leaves its grad mode as it was
            code = args.run(args)
    except (ValueError, TypeError, OSError, RuntimeError, FloatingPointError) as e:
        print(f"kvwire: error: {e}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
