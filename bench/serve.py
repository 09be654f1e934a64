"""`kvwire serve` under load vs llama.cpp's server (llama-cpp-python's `llama_cpp.server`), both serving
the preset's GGUF file on 127.0.0.1 with the same number of threads.

    python bench/serve.py [--model smollm2-135m-instruct] [--clients 1,4,16] [--max-tokens 32]
                          [--requests-per-client 2] [--threads 2] [--quantize gguf] [--skip-peer] [--quick]
                          [--repeat 1] [--max-length 2048] [--omp-wait-policy PASSIVE] [--[no-]compile]
                          [--warm] [--warm-minutes 40] [--chat-template FILE --peer-chat-format NAME]
                          [--decode-threads N]

A model whose GGUF carries no chat template (the Gemma 3 preset) runs with one given to both servers:
`--chat-template bench/templates/gemma.jinja --peer-chat-format gemma` (Gemma's turns, as
llama-cpp-python's "gemma" format writes them; the bench prints each server's token count of the first
prompt, which should agree).

On a CPU that other work keeps busy, torch's OpenMP threads spinning at every op's barrier make
kvwire's server many times slower (measured: 0.7 vs 12.9 tokens/s at one client, 2 threads, load
average 9); --omp-wait-policy PASSIVE sets OMP_WAIT_POLICY for kvwire's servers.

Measures, in one run, with the servers as child processes started (on free ports, polled until
ready) and stopped by this script:
1. throughput (completion tokens / wall seconds) and time to first token (TTFT, mean and p50) with
   1, 4 and 16 concurrent clients, each sending --requests-per-client streaming greedy chat
   completions (five short user prompts in turn, --max-tokens each) one after the other, each cell
   the best of --repeat runs with the servers taking turns. llama.cpp's server
   answers one request at a time (started with --interrupt_requests False: by default a waiting
   request cuts the streaming one short);
2. the same at the largest client count on a kvwire server started with --control-vector happy=FILE,
   once with no request steered, once with half of them carrying "steer": {"happy": 0.8}, and once
   with every request carrying its own inline vector ("steer_vectors", base64, a random direction
   per block, one of 16); FILE is a random direction per block (a random one costs what a trained
   one costs);
3. prefix reuse: a ~1,000-token user message (turn 1, 16 new tokens), then turn 2 = turn 1 + the
   reply + a short question; turn 2's TTFT vs that of the same conversation with another first word
   (nothing shared: a full prefill), and usage's cached_tokens.
With compiled steps (the server's default for GGUF blocks, or --compile) and --warm, the loads of
1. to 3. first run untimed on kvwire's servers, then the bench waits until their child processes
have built every compiled step met (their
`kvwire_compiled_steps_building` gauge), pass after pass until one builds nothing: the timed runs are
then those of a server whose steps are all built. Without --warm, a fresh step folder shows a
server that meets its shapes for the first time (served eager while they build).
Then the goal lines (throughput >= 1.0x llama.cpp at the largest client count, steering costing
< 10 % of throughput, prefix reuse >= 5x sooner) with the measured ratios, and each server's peak
RSS (VmHWM). A server that is missing, fails to start or dies gets rows saying so; the rest prints.
"""
import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402
from generate import gguf_of  # noqa: E402
from serve_load import PROMPTS, Server, median, prefix_reuse, prompt_tokens, run_load  # noqa: E402

STEER = {"happy": 0.8}
NONE, HALF = (lambda k: None), (lambda k: STEER if k % 2 == 0 else None)  # steer_of(request index)
INLINE = []  # filled by inline_vectors: request k carries INLINE[k % 16]


def each_inline(k):
    return [INLINE[k % len(INLINE)]]


def inline_vectors(gguf, scale=0.05, count=16):
    """`count` inline vectors (base64 little-endian float32, a random direction per block 1..n-1)."""
    import base64

    import numpy as np

    from kvwire.io.gguf import GGUFFile

    f = GGUFFile(gguf)
    width, blocks = f.field(f"{f.architecture}.embedding_length"), f.field(f"{f.architecture}.block_count")
    rng = np.random.default_rng(1)
    INLINE[:] = [{"directions": {str(i): base64.b64encode((rng.standard_normal(width) * scale).astype("<f4").tobytes())
                                 .decode() for i in range(1, blocks)}, "strength": 0.8} for _ in range(count)]
FULL = dict(clients="1,4,16", max_tokens=32, requests_per_client=2, prefix_words=800, prefix_repeats=3)
QUICK = dict(clients="1,4", max_tokens=8, requests_per_client=1, prefix_words=200, prefix_repeats=1)


def control_vector(gguf, path, scale=0.05, seed=0):
    """A random direction per block 1..n-1 (block 0 cannot be stored) of the GGUF model's width."""
    import torch

    from kvwire.io.gguf import GGUFFile
    from kvwire.steer import ControlVector

    f = GGUFFile(gguf)
    width, blocks = f.field(f"{f.architecture}.embedding_length"), f.field(f"{f.architecture}.block_count")
    g = torch.Generator().manual_seed(seed)
    ControlVector({i: torch.randn(width, generator=g) * scale for i in range(1, blocks)}).save(path)


def auto_weights(model):
    """What `kvwire serve --quantize auto` (its default) picks for `model`, for the header."""
    from kvwire.load import auto_quantize

    return auto_quantize(model)[0] or "float32"


def compiled(args):
    """Whether kvwire's servers decode on compiled steps: --compile / --no-compile, else the server's
    default for the weights it picks (on for GGUF blocks)."""
    from kvwire.cli.serve import compiled_choice

    weights = auto_weights(args.model) if args.quantize in (None, "auto") else args.quantize  # as the server
    return compiled_choice(argparse.Namespace(compile=args.compile), weights)[0]


def servers_to_start(args, gguf, vector):
    """{label: (argv after python, ready path, env)}."""
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               **({"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {})}
    batch = max(args.clients)
    kvwire = ["-m", "kvwire.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "{port}",
              "--max-batch", str(batch), "--max-length", str(args.max_length), "--inline-slots", str(batch)]
    kvwire += ["--quantize", args.quantize] if args.quantize else []
    kvwire += {True: ["--compile"], False: ["--no-compile"], None: []}[args.compile]
    kvwire += ["--chat-template", args.chat_template] if args.chat_template else []
    kvwire += ["--decode-threads", str(args.decode_threads)] if args.decode_threads else []
    out = {"kvwire": (kvwire, "/health", threads),
           "kvwire +happy": (kvwire + ["--control-vector", f"happy={vector}"], "/health", threads)}
    if not args.skip_peer:
        out["llama.cpp"] = (["-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(args.threads),
                             "--n_threads_batch", str(args.threads), "--host", "127.0.0.1", "--port", "{port}",
                             "--n_ctx", str(args.max_length), "--interrupt_requests", "False"]
                            + (["--chat_format", args.peer_chat_format] if args.peer_chat_format else []),
                            "/v1/models", {})
    return out


def start(specs, timeout):
    """Start every server at once, then wait for each: ({label: Server}, {label: why it is not up})."""
    servers = {label: Server(label, argv, ready, env) for label, (argv, ready, env) in specs.items()}
    down = {label: f"did not start: {s.failure}" for label, s in servers.items() if not s.wait(timeout)}
    return servers, down


def measure(label, server, down, clients, args, steer_of=NONE, steered=""):
    """A `Load` of `server` (None, with down[label] saying why, when it is down or a request failed)."""
    if label in down:
        return None
    load = run_load(server.url, server.model, clients, args.requests_per_client, args.max_tokens, steer_of)
    if not server.alive():
        down[label] = f"died during the {clients}-client run{steered}: {server.failure}"
        return None
    return load


def throughput_rows(servers, down, args):
    """Print the throughput table (each cell the best of --repeat runs, the servers taking turns in
    each); returns {(row name, clients): Load} of the runs that succeeded."""
    cols = ["clients", "requests", "tokens", "wall s", "tokens/s", "TTFT mean s", "TTFT p50 s", "cached %"]
    print(f"{'server':34}" + "".join(f"{c:>12}" for c in cols))
    most, loads, said = max(args.clients), {}, set()
    mixes = [("none steered", NONE), ("half steered", HALF), ("each inline", each_inline)]
    for clients in args.clients:
        runs = [(label, label, NONE) for label in servers if label != "kvwire +happy"]
        if clients == most and "kvwire +happy" in servers:
            runs += [("kvwire +happy", f"kvwire +happy ({how})", steer_of) for how, steer_of in mixes]
        failed = {}
        for _ in range(args.repeat):
            for label, name, steer_of in runs:
                load = measure(label, servers[label], down, clients, args, steer_of, f" ({name})")
                if load is None or load.failure():
                    failed[name] = down.get(label) or load.failure()
                elif (name, clients) not in loads or load.tokens_per_s > loads[(name, clients)].tokens_per_s:
                    loads[(name, clients)] = load
        for _, name, _ in runs:
            if name in failed:
                loads.pop((name, clients), None)
                print(f"{name:34}{clients:12}  {'(as above)' if failed[name] in said else failed[name]}")
                said.add(failed[name])
                continue
            load = loads[(name, clients)]
            cells = [len(load.ok), load.tokens, load.wall, load.tokens_per_s, load.ttft(statistics.mean),
                     load.ttft(statistics.median)]
            # TTFTs in 3 decimals: at one client they differ by milliseconds
            print(f"{name:34}{clients:12}" + "".join(f"{c:12}" if isinstance(c, int) else f"{c:12.2f}" for c in cells[:4])
                  + "".join(f"{c:12.3f}" for c in cells[4:])
                  + (f"{'n/a':>12}" if load.cached_share != load.cached_share else f"{load.cached_share:12.0%}"))
        ours, theirs = loads.get(("kvwire", clients)), loads.get(("llama.cpp", clients))
        if ours and theirs:
            print(f"{'  kvwire/llama.cpp':34}{clients:12}{'':36}{ours.tokens_per_s / theirs.tokens_per_s:12.2f}"
                  f"{ours.ttft(statistics.mean) / theirs.ttft(statistics.mean):12.2f}"
                  f"{ours.ttft(statistics.median) / theirs.ttft(statistics.median):12.2f}")
    return loads


def steering_check(loads, clients):
    """How many steered replies differ from the unsteered reply to the same prompt (the vector acts)."""
    plain, mixed = loads.get(("kvwire +happy (none steered)", clients)), loads.get(("kvwire +happy (half steered)",
                                                                                    clients))
    if not (plain and mixed):
        return ""
    pairs = [(a.text, b.text) for k, (a, b) in enumerate(zip(plain.replies, mixed.replies)) if k % 2 == 0]
    return f"{sum(a != b for a, b in pairs)} of {len(pairs)} steered replies differ from the unsteered reply"


def prefix_rows(servers, down, args):
    """Print the prefix-reuse table; returns {label: (reused TTFT, fresh TTFT, cached, prompt tokens)}."""
    cols = ["prompt tok", "turn-1 TTFT", "reused TTFT", "cached tok", "fresh TTFT", "fresh cached", "fresh/reused"]
    print(f"\nprefix reuse (turn 2 of a ~{args.prefix_words}-word conversation, median of {args.prefix_repeats})")
    print(f"{'server':34}" + "".join(f"{c:>13}" for c in cols))
    out = {}
    for label in (k for k in servers if k != "kvwire +happy"):
        server = servers[label]
        triples = [] if label in down else prefix_reuse(server.url, server.model, args.prefix_words,
                                                        args.prefix_repeats)
        errors = [r.error for t in triples for r in t if r.error]
        if label in down or errors or not server.alive():
            why = down.get(label) or (errors[0] if errors else f"died: {server.failure}")
            print(f"{label:34}  {why}")
            continue
        turn1, reused, fresh = (median(r.ttft for r in replies) for replies in zip(*triples))
        last = triples[-1]
        out[label] = (reused, fresh, last[1].cached_tokens, last[1].prompt_tokens)
        text = lambda v: f"{'n/a':>13}" if v is None else f"{v:13}"  # noqa: E731
        print(f"{label:34}{text(last[1].prompt_tokens)}{turn1:13.2f}{reused:13.2f}{text(last[1].cached_tokens)}"
              f"{fresh:13.2f}{text(last[2].cached_tokens)}{fresh / reused:13.2f}")
    return out


def warm(servers, down, args):
    """--warm: the throughput and prefix loads, untimed, on kvwire's servers, then a wait for the
    compiled steps their children build, until a pass leaves nothing to build or the budget ends."""
    ours = [label for label in servers if label.startswith("kvwire") and label not in down]
    start, deadline = time.monotonic(), time.monotonic() + 60 * args.warm_minutes
    passes, left = 0, {}
    while time.monotonic() < deadline:
        passes += 1
        for label in ours:
            s = servers[label]
            for clients in args.clients:
                for steer_of in ((NONE, HALF, each_inline) if label == "kvwire +happy" else (NONE,)):
                    run_load(s.url, s.model, clients, args.requests_per_client, args.max_tokens, steer_of)
            if label == "kvwire":
                prefix_reuse(s.url, s.model, args.prefix_words, 1, first_seed=2000 + passes)  # not the timed texts
        built = False
        while time.monotonic() < deadline:
            left = {label: building(servers[label]) for label in ours}
            if not any(left.values()):
                break
            built = True
            time.sleep(5)
        if not built:
            break
    print(f"warm-up (--warm): {passes} pass(es) of the load in {time.monotonic() - start:.0f} s; compiled steps "
          f"still building: " + ", ".join(f"{label} {n}" for label, n in left.items()), flush=True)


def building(server):
    """The server's kvwire_compiled_steps_building gauge (0 where it cannot be read)."""
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return 0
    line = next((ln for ln in text.splitlines() if ln.startswith("kvwire_compiled_steps_building ")), "")
    return int(float(line.split()[1])) if line else 0


def goal(name, target, measured, met):
    """One goal line; met None: not measured (`measured` then says why)."""
    print(f"goal: {name}: not measured ({measured})" if met is None else
          f"goal: {name}: {measured} (goal {target}): {'met' if met else 'NOT met'}")


def goals(loads, prefix, down, most):
    ours, theirs = loads.get(("kvwire", most)), loads.get(("llama.cpp", most))
    name = f"throughput at {most} clients"
    if ours and theirs:
        r = ours.tokens_per_s / theirs.tokens_per_s
        goal(name, ">= 1.0x", f"kvwire {ours.tokens_per_s:.1f} / llama.cpp {theirs.tokens_per_s:.1f} tokens/s = "
             f"{r:.2f}x", r >= 1.0)
    else:
        goal(name, "", down.get("llama.cpp") or down.get("kvwire") or "a run failed (see the table)", None)
    mixed = loads.get(("kvwire +happy (half steered)", most))
    name = f"steering's throughput cost at {most} clients, half the requests steered"
    if ours and mixed:
        cost = 1 - mixed.tokens_per_s / ours.tokens_per_s
        goal(name, "< 10 %", f"1 - {mixed.tokens_per_s:.1f} / {ours.tokens_per_s:.1f} tokens/s (no control vector) "
             f"= {cost:.1%}", cost < 0.10)
    else:
        goal(name, "", down.get("kvwire +happy") or down.get("kvwire") or "a run failed (see the table)", None)
    inline, plain = loads.get(("kvwire +happy (each inline)", most)), loads.get(("kvwire +happy (none steered)", most))
    name = f"inline vectors' throughput cost at {most} clients, each request its own vector"
    if plain and inline:  # the same server, runs side by side
        cost = 1 - inline.tokens_per_s / plain.tokens_per_s
        goal(name, "<= 10 %", f"1 - {inline.tokens_per_s:.1f} / {plain.tokens_per_s:.1f} tokens/s (none steered) "
             f"= {cost:.1%}", cost <= 0.10)
    else:
        goal(name, "", down.get("kvwire +happy") or down.get("kvwire") or "a run failed (see the table)", None)
    if "kvwire" in prefix:
        reused, fresh, cached, prompt = prefix["kvwire"]
        goal("prefix reuse, turn-2 TTFT", ">= 5x", f"full prefill {fresh:.2f} s / reused {reused:.2f} s = "
             f"{fresh / reused:.1f}x, cached_tokens {cached} of {prompt}", fresh / reused >= 5)
    else:
        goal("prefix reuse, turn-2 TTFT", "", down.get("kvwire") or "the run failed (see above)", None)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a kvwire preset (a chat model)")
    p.add_argument("--clients", help=f"concurrent clients, comma-separated (default {FULL['clients']})")
    p.add_argument("--max-tokens", type=int, help=f"per request (default {FULL['max_tokens']})")
    p.add_argument("--requests-per-client", type=int, help=f"default {FULL['requests_per_client']}")
    p.add_argument("--prefix-words", type=int, help=f"turn 1's long message (default {FULL['prefix_words']})")
    p.add_argument("--prefix-repeats", type=int, help=f"default {FULL['prefix_repeats']}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="throughput runs per cell, the best kept (default 1)")
    p.add_argument("--max-length", type=int, default=2048, help="kvwire's --max-length and llama.cpp's --n_ctx")
    p.add_argument("--omp-wait-policy", choices=["ACTIVE", "PASSIVE"],
                   help="OMP_WAIT_POLICY of kvwire's servers (default: unset, OpenMP's own; on a CPU other work "
                   "keeps busy, PASSIVE spares torch's threads from spinning at every op's barrier)")
    p.add_argument("--quantize", help="passed to kvwire serve (gguf, none, ...); default: the server's own (auto: the "
                   "GGUF's blocks on ggml's kernels where llama-cpp-python is installed)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="kvwire serve --compile / --no-compile (compiled steps kept on disk, built by child "
                   "processes while the shapes they serve run eager; see --warm); default: the server's own (on "
                   "for GGUF blocks)")
    p.add_argument("--warm", action="store_true",
                   help="with compiled steps: before timing, run the whole load untimed on kvwire's servers, wait "
                   "until their compiled steps are built (their /metrics gauge), and again until a pass builds nothing")
    p.add_argument("--decode-threads", type=int, default=None, metavar="N",
                   help="kvwire serve --decode-threads (default: the server's own, one fewer than --threads)")
    p.add_argument("--warm-minutes", type=float, default=40, help="--warm's budget (default %(default)s)")
    p.add_argument("--skip-peer", action="store_true", help="do not start llama.cpp's server")
    p.add_argument("--chat-template", default=None, metavar="FILE.jinja",
                   help="kvwire serve --chat-template (for a model whose GGUF carries none)")
    p.add_argument("--peer-chat-format", default=None, metavar="NAME",
                   help="llama.cpp's server --chat_format (e.g. gemma, with --chat-template bench/templates/gemma.jinja)")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for a server to become ready")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    return p


def resolve(args, p):
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.clients = sorted({int(c) for c in str(args.clients).split(",")})
    except ValueError:
        p.error(f"--clients must be comma-separated ints like 1,4,16, got {args.clients!r}")
    if args.clients[0] < 1:
        p.error(f"--clients must be >= 1, got {args.clients}")
    return args


def main(argv=None):
    p = parser()
    args = resolve(p.parse_args(argv), p)
    gguf, file_type = gguf_of(args.model, p)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped below
    print(header(args.threads), flush=True)
    policy = f" (OMP_WAIT_POLICY={args.omp_wait_policy})" if args.omp_wait_policy else ""
    steps = " +compile" if compiled(args) else " eager steps"
    print(f"model: {args.model} ({os.path.basename(gguf)}, {file_type}); "
          f"kvwire {args.quantize or auto_weights(args.model)}{policy}{steps}, "
          f"llama.cpp the file's own blocks; {args.requests_per_client} requests per client, "
          f"max_tokens {args.max_tokens}, greedy, streamed; load average {os.getloadavg()[0]:.1f} at the start "
          f"(other work on the machine makes timings noisy)", flush=True)
    servers = {}
    with tempfile.TemporaryDirectory() as tmp:
        vector = os.path.join(tmp, "happy.gguf")
        control_vector(gguf, vector)
        inline_vectors(gguf)
        try:
            servers, down = start(servers_to_start(args, gguf, vector), args.start_timeout)
            for label, s in servers.items():  # a first request each (and a full batch) before timing
                if label not in down:
                    run_load(s.url, s.model, 1, 1, 2)
                    run_load(s.url, s.model, max(args.clients), 1, 2, HALF if label == "kvwire +happy" else NONE)
            if args.warm and compiled(args):
                warm(servers, down, args)
            sizes = {label: prompt_tokens(s.url, s.model, PROMPTS[0]) for label, s in servers.items()
                     if label not in down}
            print("the first prompt rendered by each server's chat template: " + ", ".join(
                f"{label} {n} tokens" for label, n in sizes.items()), flush=True)
            loads = throughput_rows(servers, down, args)
            prefix = prefix_rows(servers, down, args)
            rss = {label: s.peak_rss_gb() for label, s in servers.items()}
        finally:
            for s in servers.values():
                s.stop()
    print("\npeak RSS GB (VmHWM): " + ", ".join(f"{label} {gb:.2f}" if gb == gb else f"{label} not running"
                                                for label, gb in rss.items()))
    most = max(args.clients)
    goals(loads, prefix, down, most)
    check = steering_check(loads, most)
    print(f"the control vector is a random direction per block (a random one costs what a trained one costs)"
          f"{'; ' + check if check else ''}")
    print("tokens: kvwire's usage.completion_tokens; llama.cpp's server sends no usage when streaming, so its "
          "chunks with text (one token each); TTFT: seconds from sending to the first chunk with text; "
          "kvwire/llama.cpp rows: tokens/s above 1 is faster, TTFT below 1 is sooner; cached %: prompt tokens "
          "kvwire's prefix store served (the short prompts repeat; llama.cpp reuses only the previous request's "
          "prefix and does not say)")


if __name__ == "__main__":
    main()
