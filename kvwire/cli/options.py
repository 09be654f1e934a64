"""What the commands share: samplers from options, model loading, option groups, terminal output."""
import argparse
import sys

from ..kernels import switches, threads
from ..layers.site import ALL_SITES as SITES
from ..quant import SCHEMES

SAMPLERS = ("greedy", "random", "top-k", "top-p", "min-p", "beam")


# the option each sampler reads; an option of another sampler would be dropped silently
_OPTION_OF = {"top-k": "top_k", "top-p": "top_p", "min-p": "min_p", "beam": "beams"}


def make_sampler(args):
    """The sampler object the command-line options describe. kvwire's samplers are one filter
    each, so options of two samplers (--top-k with --top-p, --sampler random with --top-k) are
    refused rather than one being dropped."""
    from .. import generate as g

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


def load_model(args, quantize=None):
    """The model the options name (quantised when asked), steered by --control-vector when given."""
    from ..load import load
    from ..steer import ControlVector

    if getattr(args, "runtime", "eager") != "eager":
        from ..export import load_exported
        given = [f"--{o.replace('_', '-')}" for o in ("control_vector", "ablate", "clamp", "sae")
                 if getattr(args, o, None)]
        if given:
            raise ValueError(f"{given[0]} applies to eager models; export a steered model instead "
                             "(kvwire export --control-vector V ...) and pass --strength at run time")
        if getattr(args, "device", "cpu") != "cpu":
            raise ValueError(f"--device {args.device} applies to eager models; --runtime {args.runtime} runs on "
                             "its own runtime's CPU provider")
        if quantize or getattr(args, "head", None):
            raise ValueError(f"--quantize and --head apply to eager models; --runtime {args.runtime} runs the "
                             "file's own weights (export with kvwire export --quantize for ONNX)")
        return load_exported(args.model)
    clamps = [clamp_spec(spec) for spec in getattr(args, "clamp", None) or []]  # refused before loading
    heads = head_specs(getattr(args, "ablate_heads", None))
    features = feature_specs(getattr(args, "sae", None), getattr(args, "feature", None))
    quantize = None if quantize == "none" else quantize
    template = chat_template_file(getattr(args, "chat_template", None))  # a bad file is refused before loading
    lm = load(args.model, dtype=args.dtype, quantize=quantize, head=getattr(args, "head", None),
              device=getattr(args, "device", "cpu"))
    if template is not None:
        if lm.tokenizer is None:
            raise ValueError(f"--chat-template {args.chat_template}: {args.model} has no tokenizer to render it with")
        lm.tokenizer.chat_template = template
    site = getattr(args, "site", None)  # None: each vector's own
    when = "generated" if getattr(args, "generated_only", False) else None
    if getattr(args, "control_vector", None):
        lm = lm.steer(ControlVector.load(args.control_vector), args.strength, site=site, when=when)
    for path in getattr(args, "ablate", None) or []:
        lm = lm.ablate(ControlVector.load(path), site=site, when=when)
    for path, lo, hi in clamps:
        vector = ControlVector.load(path)
        if lo is None and hi is None and vector.strength is None:
            raise ValueError(f"--clamp {path}: the file recommends no value to hold the projection at; give "
                             f"{path}=LO,HI")
        lm = lm.clamp(vector, lo, hi, site=site, when=when)
    if heads:
        from ..steer import head_basis

        lm = lm.ablate(head_basis(lm, heads), site="attn_heads", when=when, name="heads")
    if features:
        from ..steer import SAE

        lm = lm.steer_features(SAE.load(args.sae), features, mode=args.feature_mode, when=when)
    return lm


def chat_template_option(p):
    p.add_argument("--chat-template", default=None, metavar="FILE.jinja",
                   help="render conversations with this jinja chat template instead of the model's own (for a "
                        "model whose files carry none, or another one)")


def chat_template_file(path):
    """--chat-template FILE -> a ChatTemplate (None without one); a missing, unreadable or
    non-compiling file is refused naming it."""
    if path is None:
        return None
    from ..io.chat_template import ChatTemplate

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({e}); expected a UTF-8 jinja file") from None
    if not source.strip():
        raise ValueError(f"--chat-template {path}: the file is empty; expected a jinja chat template")
    return ChatTemplate(source, f"--chat-template {path}")


def head_specs(specs):
    """--ablate-heads B:H,H ... -> {block: [heads]} (None without any); refused by name when malformed."""
    out = {}
    for spec in specs or []:
        block, sep, heads = spec.partition(":")
        try:
            picked = [int(h) for h in heads.split(",")]
            out.setdefault(int(block), []).extend(picked)
        except ValueError:
            raise ValueError(f"--ablate-heads takes BLOCK:H[,H...] (a block and head indices), got {spec!r}") from None
        if not sep:
            raise ValueError(f"--ablate-heads takes BLOCK:H[,H...] (a block and head indices), got {spec!r}")
    return out or None


def feature_specs(sae, specs):
    """--sae FOLDER with --feature I=V ... -> {I: V} (None without --sae); refused when one comes alone."""
    if bool(sae) != bool(specs):
        raise ValueError("--sae FOLDER and --feature I=V go together: give both (the SAE and what to set)")
    if not sae:
        return None
    out = {}
    for spec in specs:
        index, sep, value = spec.partition("=")
        try:
            out[int(index)] = float(value)
        except ValueError:
            raise ValueError(f"--feature takes I=V (a feature index and a number), got {spec!r}") from None
        if not sep:
            raise ValueError(f"--feature takes I=V (a feature index and a number), got {spec!r}")
    return out


def clamp_spec(spec):
    """"VEC.gguf=LO,HI" -> (path, lo or None, hi or None); a bare "VEC.gguf" -> (path, None, None)
    (the file's recommended value)."""
    if "=" not in spec and spec.lower().endswith(".gguf"):
        return spec, None, None
    path, sep, bounds = spec.rpartition("=")
    lo, comma, hi = bounds.partition(",")
    try:
        values = [float(v) if v.strip() else None for v in (lo, hi)]
    except ValueError:
        values = None
    if not (sep and path and comma and values is not None):
        raise ValueError(f"--clamp takes VEC.gguf=LO,HI (LO or HI may be empty) or VEC.gguf, got {spec!r}")
    return (path, *values)


def named_files(pairs):
    """--control-vector NAME=FILE options as {name: file}."""
    from ..serve.options import check_names

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


def report(prefill, new, steps, seconds):
    rate = steps / seconds if seconds > 0 else float("nan")
    print(f"prefill {prefill * 1000:.0f} ms, {new} new tokens, decode {rate:.1f} tokens/s", file=sys.stderr)


def echo(pieces):
    for piece in pieces:
        print(piece, end="", flush=True)
        yield piece


def positive(text):
    """argparse type: an int >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return int(text)


def use_threads(args):
    """Size torch's CPU thread pool as --threads (or KVWIRE_THREADS) asks, before any model work."""
    n = getattr(args, "threads", None) or switches.threads()
    if n is not None:
        threads.pin(n)  # a count the user chose: engines keep it under load too


def sampling_options(p, max_new_tokens=None):
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


def steer_options(p):
    p.add_argument("--control-vector", default=None, metavar="VEC.gguf", help="steer with this control vector")
    p.add_argument("--strength", type=float, default=None,
                   help="control-vector strength (default: the file's recommended strength, else 1.0; for "
                        "--runtime onnx: the exported default)")
    p.add_argument("--generated-only", action="store_true", help="steer generated tokens only, not the prompt")
    p.add_argument("--site", default=None, choices=SITES,
                   help="where in each block --control-vector, --ablate and --clamp act (default: the site each "
                        "vector file records, block_out for a llama.cpp vector)")
    p.add_argument("--ablate", action="append", default=None, metavar="VEC.gguf",
                   help="project each block's direction of this vector out of the hidden state, as much as the "
                        "file recommends (default all of it; repeatable)")
    p.add_argument("--clamp", action="append", default=None, metavar="VEC.gguf=LO,HI",
                   help="hold the projection on each block's direction in [LO, HI] (either may be empty: "
                        "unbounded; a bare VEC.gguf: at the file's recommended value; repeatable)")
    p.add_argument("--ablate-heads", action="append", default=None, metavar="B:H,H",
                   help="zero attention heads H of block B (their outputs before the output projection, site "
                        "attn_heads; repeatable)")
    p.add_argument("--sae", default=None, metavar="FOLDER",
                   help="a sparse autoencoder in SAELens's format (cfg.json + sae_weights.safetensors) whose "
                        "--feature values are edited at its hook")
    p.add_argument("--feature", action="append", default=None, metavar="I=V",
                   help="with --sae: feature I set to V (or V added, with --feature-mode add; repeatable)")
    p.add_argument("--feature-mode", default="set", choices=("set", "add"), help="how --feature values apply")


def quantize_option(p, default=None):
    p.add_argument("--quantize", default=default, metavar="Q",
                   help="weights of the eager model: 'gguf' (a GGUF file's own quantised blocks on ggml's "
                        f"kernels), a ggml type (q8_0, q5_0, q4_k, ...), {' / '.join(SCHEMES)} (PyTorch kernels), "
                        "'auto' ('gguf' where ggml runs the file's blocks, else float), or 'none'"
                        + (f" (default: {default})" if default else ""))
    p.add_argument("--head", default=None, metavar="Q",
                   help="with --quantize gguf: re-quantise the logits head to ggml type Q (q5_0: a smaller head, "
                        "most of a decode step's bytes) straight from the file's blocks")


def model_options(p):
    p.add_argument("--model", default="gemma3-270m", help="preset name, GGUF file or HF folder (default: %(default)s)")
    p.add_argument("--threads", type=positive, default=None, metavar="N",
                   help="threads of torch's CPU pool, kept whatever else runs (default: $KVWIRE_THREADS, else one "
                        "per core, and one fewer for each core other processes keep busy)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--device", default="cpu", metavar="D",
                   help="where the weights, caches and steps live: cpu, cuda, cuda:1, ... (GGUF blocks and the "
                        "int8/int4 kernels run on the CPU only; default: %(default)s)")
