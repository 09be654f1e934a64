"""`kvwire serve`: the model over OpenAI's HTTP API."""
import argparse
import sys

from ..serve import limits, ray_serve  # ray_serve imports no Ray until --ray runs
from .options import chat_template_option, load_model, model_options, named_files, positive, quantize_option


def add(commands):
    s = commands.add_parser("serve", help="serve the model over OpenAI's HTTP API",
                            description="An OpenAI-compatible server: POST /v1/chat/completions, /v1/completions, "
                            "GET /v1/models, /health, /metrics. Requests choose control-vector strengths with "
                            "\"steer\": {NAME: strength} (absent names: 0).")
    model_options(s)
    chat_template_option(s)
    quantize_option(s, default="auto")  # a server batches: ggml's blocks beat float weights where they run
    s.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compiled decode steps, kept on disk: each batch size (1, 2, 4, ...) and timeline length "
                   "(256, 512, ...) the server meets is built once, ever, by a child process on idle CPU time (a "
                   "minute or two; requests run eager meanwhile, after a few seconds' export); later starts load "
                   "them in about a second (default: on for a GGUF file's blocks on ggml's kernels, off otherwise)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument("--control-vector", action="append", default=None, metavar="NAME=FILE",
                   help="a control vector requests may steer with as \"steer\": {NAME: strength} (repeatable)")
    s.add_argument("--max-batch", type=int, default=None, metavar="N", help="sequences decoding at once (default 8, "
                   "fewer when memory is short); more requests wait")
    s.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="prompt + completion per request (default: the model's context, at most 4096, less when "
                   "memory is short); --max-batch x --max-length rows of keys/values must fit the memory available")
    s.add_argument("--inline-slots", type=int, default=None, metavar="K",
                   help="vectors requests may carry inline (\"steer_vectors\") at once, server-wide; more get 429 "
                   "(default: --max-batch; 0: none)")
    s.add_argument("--inline-per-request", type=int, default=2, metavar="N",
                   help="inline vectors one request may carry (default %(default)s)")
    s.add_argument("--sae", default=None, metavar="FOLDER",
                   help="an SAELens SAE folder (cfg.json, sae_weights.safetensors) whose features requests set, add "
                   "to or clamp with \"sae_features\": {INDEX: value} and \"sae_mode\"")
    s.add_argument("--sae-site", default=None, metavar="SITE",
                   help="the site the SAE edits (default: its hook's, e.g. block_out for hook_resid_post)")
    s.add_argument("--sae-layer", type=int, default=None, metavar="N",
                   help="the block the SAE edits (default: its hook's)")
    s.add_argument("--sae-slots", type=positive, default=None, metavar="F",
                   help="distinct SAE features in use at once, server-wide (requests asking for the same feature "
                   "share one); more get 429 (default: 2 x --max-batch)")
    s.add_argument("--sae-per-request", type=positive, default=4, metavar="N",
                   help="SAE features one request may carry (default %(default)s)")
    limits.add_arguments(s)
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; also $KVWIRE_API_KEYS, "
                   "comma-separated, which keeps keys off the command line); /health, the playground page and "
                   "/docs stay open")
    s.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="an origin whose pages may call the API from a browser, e.g. https://app.example.com "
                   "(repeatable; default: none)")
    s.add_argument("--no-tool-fallback", dest="tool_fallback", action="store_false",
                   help="refuse tools (400) for a model whose chat template has no tool support, instead of kvwire's "
                   "convention (tool schemas in a system message, calls as <tool_call> JSON)")
    s.add_argument("--decode-threads", type=positive, default=None, metavar="N",
                   help="torch threads for decode steps (default: the whole pool for compiled steps; one fewer, at "
                   "least 1, for eager steps, so the server's event loop has a core; prefill uses the whole pool)")
    s.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="do not serve GET /metrics nor record what it reports")
    s.add_argument("--no-playground-training", dest="playground_training", action="store_false",
                   help="the playground's training and sweep endpoints answer 403 (its vectors can still be listed "
                   "and downloaded)")
    s.add_argument("--no-analysis", dest="analysis", action="store_false",
                   help="POST /kvwire/capture, /kvwire/patch and /kvwire/evaluate (activations, activation "
                   "patching, a vector's evaluation) answer 403")
    s.add_argument("--max-capture-values", type=positive, default=None, metavar="N",
                   help="floats one capture may hold: prompts x tokens x sites x layers x width (default 4194304)")
    s.add_argument("--max-patch-rows", type=positive, default=None, metavar="N",
                   help="patched runs one patching request may make: sites x layers x positions (default 1024)")
    s.add_argument("--max-eval-strengths", type=positive, default=None, metavar="N",
                   help="strengths one evaluation request may measure (default 41)")
    s.add_argument("--max-eval-examples", type=positive, default=None, metavar="N",
                   help="A/B examples one evaluation request may carry (default 256)")
    s.add_argument("--max-eval-neutral-tokens", type=positive, default=None, metavar="N",
                   help="tokens of neutral text one evaluation request may carry (default 4096)")
    ray_serve.add_arguments(s)
    s.set_defaults(run=run)


def api_keys(args):
    """The keys of --api-key and $KVWIRE_API_KEYS together (None: neither gives one). An empty one is
    refused later, never dropped: `--api-key "$UNSET"` must not start a server open to all."""
    from ..kernels import switches

    keys = list(args.api_key or [])
    listed = switches.get("KVWIRE_API_KEYS")
    if listed is not None:
        keys += [k.strip() for k in listed.split(",") if k.strip()] or [""]
    return keys or None


def decode_threads(pool, compiled):
    """Torch threads for decode steps: the whole pool for compiled steps, whose Python work a token
    is small; one fewer (at least 1) for eager steps, whose op-by-op Python would otherwise fight
    the event loop for a core (measured on 2 cores in docs/performance.md)."""
    return pool if compiled else max(1, pool - 1)


def run(args):
    import logging

    import torch

    from ..dtypes import weights_device
    from ..serve import create_app, serve
    from ..serve.auth import check_keys
    from ..steer import ControlVector

    named = named_files(args.control_vector or [])  # refuse bad NAME=FILE before loading anything
    bounds = limits.from_args(args)
    keys = api_keys(args)
    if keys is not None:
        check_keys(keys)  # before the model loads: a bad key is refused at once
    vectors = {name: ControlVector.load(path) for name, path in named.items()}
    sae = _sae(args)  # a bad folder or option is refused before the model loads
    weights_device(args.device)  # so is a device this process cannot use
    if args.quantize == "auto" and getattr(args, "runtime", "eager") == "eager":
        from ..load import auto_quantize

        args.quantize, why = auto_quantize(args.model, args.device)
        print(f"weights: {why} (--quantize {args.quantize or 'none'})", file=sys.stderr)
    options = dict(max_batch=args.max_batch, max_length=args.max_length, control_vectors=vectors, limits=bounds,
                   inline_slots=args.inline_slots, inline_per_request=args.inline_per_request, api_keys=keys,
                   cors_origins=args.cors_origin, playground_training=args.playground_training,
                   tool_fallback=args.tool_fallback, metrics=args.metrics,
                   sae_slots=args.sae_slots,
                   sae_per_request=args.sae_per_request, sae_site=args.sae_site, sae_layer=args.sae_layer,
                   analysis=args.analysis, analysis_limits=_analysis_limits(args))
    args.compile, compiled_why = compiled_choice(args, args.quantize)
    _say_steps(args, compiled_why)
    options["decode_threads"] = args.decode_threads or decode_threads(torch.get_num_threads(), args.compile)
    if args.ray:  # each replica loads the model itself (and the SAE, from its folder); this process only starts them
        from functools import partial

        loader = partial(load_served, argparse.Namespace(**{**vars(args), "control_vector": None}), args.quantize)
        return ray_serve.run_from_args(args, loader, sae=args.sae, **options)
    lm = load_served(argparse.Namespace(**{**vars(args), "control_vector": None}), args.quantize)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    app = create_app(lm, args.model, sae=sae, **options)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1 (control vectors: "
          f"{', '.join(vectors) or 'none'}; SAE: {args.sae or 'none'}; "
          f"API keys: {len(keys) if keys else 'none, open to all'}); "
          f"playground: http://{args.host}:{args.port}/", file=sys.stderr)
    serve(app, host=args.host, port=args.port)


def _say_steps(args, why):
    """Start-up's line on decode steps: compiled (where kept) or eager, and why."""
    if args.compile and getattr(args, "device", "cpu") != "cpu":  # steps are kept on disk for the CPU only
        print(f"decode: compiled steps ({why}) through torch.compile on {args.device}: the first request of each "
              f"batch size and timeline length compiles its step (a minute or so, in this process)", file=sys.stderr)
    elif args.compile:
        from ..kernels.switches import cache_root

        print(f"decode: compiled steps ({why}), kept in {cache_root() / 'steps'}; a batch size or timeline "
              f"length met for the first time runs eager while a child process builds its step on idle CPU time "
              f"(a minute or two, once)", file=sys.stderr)
    else:
        print(f"decode: eager steps ({why}); --compile decodes faster once its steps are built (in child "
              f"processes, a minute or two per batch size and timeline length met, once; kept on disk)",
              file=sys.stderr)


def compiled_choice(args, quantize):
    """(compile?, why) for `kvwire serve`: --compile / --no-compile as given, else on where the weights
    are a GGUF file's blocks on ggml's kernels (`quantize == "gguf"`). There a decode step is mostly
    small ops, which compiled steps fuse (bench/serve.py in docs/performance.md); float weights stay
    eager, as before."""
    if args.compile is not None:
        return args.compile, "--compile" if args.compile else "--no-compile"
    if quantize == "gguf":
        return True, "default for GGUF blocks; --no-compile for eager steps"
    return False, "default for float weights"


def load_served(args, quantize):
    """The model `kvwire serve` serves: `load_model`'s, compiled with --compile (module-level: Ray
    pickles it for its replicas)."""
    lm = load_model(args, quantize)
    if getattr(args, "compile", False):
        if getattr(args, "runtime", "eager") != "eager":
            raise ValueError(f"--compile applies to eager models; --runtime {args.runtime} runs its own program")
        # a server keeps answering while a new batch size's step compiles (in a child process)
        lm.compile(background=lm.device.type == "cpu")
    return lm


def _analysis_limits(args):
    """The `AnalysisLimits` of the --max-capture-values, --max-patch-rows and --max-eval-* flags
    (absent: the defaults)."""
    from ..serve.analysis import AnalysisLimits

    given = dict(capture_values=args.max_capture_values, patch_rows=args.max_patch_rows,
                 eval_strengths=args.max_eval_strengths, eval_examples=args.max_eval_examples,
                 eval_neutral_tokens=args.max_eval_neutral_tokens)
    return AnalysisLimits(**{name: value for name, value in given.items() if value is not None})


def _sae(args):
    """The SAE of --sae, read now (refusals name the folder), or None; --sae-site, --sae-layer and
    --sae-slots without --sae are refused."""
    given = [flag for flag, value in (("--sae-site", args.sae_site), ("--sae-layer", args.sae_layer),
                                      ("--sae-slots", args.sae_slots)) if value is not None]
    if args.sae is None:
        if given:
            raise ValueError(f"{', '.join(given)} need --sae FOLDER (the SAE whose features requests steer)")
        return None
    from ..layers.site import ALL_SITES
    from ..steer.sae import SAE

    if args.sae_site is not None and args.sae_site not in ALL_SITES:
        raise ValueError(f"--sae-site must be one of {list(ALL_SITES)}, got {args.sae_site!r}")
    try:
        return SAE.load(args.sae)
    except ValueError as e:
        raise ValueError(f"--sae {args.sae}: {e}") from None
