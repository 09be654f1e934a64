"""What structured outputs cost `kvwire serve`: the same load with no request constrained and with half
of them carrying a JSON schema (`response_format`), on one server in one run; and the token-mask time
per decode step, measured in the engine itself.

    python bench/serve_agents.py [--model smollm2-135m-instruct] [--clients 8] [--max-tokens 32]
                                 [--requests-per-client 2] [--repeat 5] [--threads 2] [--quick]

1. HTTP: --clients concurrent clients, each sending --requests-per-client streaming greedy chat
   completions; request k carries `response_format` json_schema when k is even ("half") or never
   ("none"). The schema asks for {"answer": a string of at least 400 characters}, so constrained rows
   run their whole budget like free ones (equal tokens, equal batch occupancy). The two loads take
   turns --repeat times; each is the best of its runs. Goal: half constrained >= 0.90x the
   throughput of none.
2. Metrics: the same load (none constrained) on a second server started with --no-metrics, the
   two servers taking turns; goal: metrics on >= 0.99x the throughput of off.
3. Engine: --clients rows of the model in one `Engine`, half constrained by the same schema, --max-tokens
   decode steps: the seconds spent computing and applying token masks per step, and their share of
   the step.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402
from serve_load import Server, run_load  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 400}}, "required": ["answer"],
          "additionalProperties": False}
FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}


def http_rows(args):
    """(half json_schema / none, metrics on / off) throughput ratios, or None where a server failed."""
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    argv = ["-m", "kvwire.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "{port}",
            "--max-batch", str(args.clients), "--max-length", "1024"]
    servers = {"kvwire": Server("kvwire", argv, "/health", threads),
               "kvwire --no-metrics": Server("kvwire --no-metrics", argv + ["--no-metrics"], "/health", threads)}
    try:
        for label, server in servers.items():
            if not server.wait(args.start_timeout):
                print(f"{label} did not start: {server.failure}")
                return None, None
        on, off = servers["kvwire"], servers["kvwire --no-metrics"]
        mixes = {"none constrained": (on, lambda k: None),
                 "half json_schema": (on, lambda k: FORMAT if k % 2 == 0 else None),
                 "none, --no-metrics": (off, lambda k: None)}
        best = {}
        for server in servers.values():  # warm-up: first requests pay one-time costs
            run_load(server.url, server.model, args.clients, 1, 4, extra_of=lambda k: FORMAT if k % 2 == 0 else None)
        for _ in range(args.repeat):
            for name, (server, extra_of) in mixes.items():
                load = run_load(server.url, server.model, args.clients, args.requests_per_client, args.max_tokens,
                                extra_of=extra_of)
                if load.failure():
                    print(f"{name}: {load.failure()}")
                    return None, None
                if name not in best or load.tokens_per_s > best[name].tokens_per_s:
                    best[name] = load
        print(f"{'load':24}{'requests':>10}{'tokens':>10}{'wall s':>10}{'tokens/s':>10}{'TTFT mean s':>13}")
        for name, load in best.items():
            ttft = sum(r.ttft for r in load.ok) / len(load.ok)
            print(f"{name:24}{len(load.ok):10}{load.tokens:10}{load.wall:10.2f}{load.tokens_per_s:10.2f}{ttft:13.3f}")
        stops = sum(r.finish_reason == "stop" for r in best["half json_schema"].ok)
        print(f"(replies ended by the model before the budget, half json_schema run: {stops})")
        plain = best["none constrained"].tokens_per_s
        return best["half json_schema"].tokens_per_s / plain, plain / best["none, --no-metrics"].tokens_per_s
    finally:
        for server in servers.values():
            server.stop()


def engine_rows(args):
    """Mask seconds per decode step with half of --clients rows constrained."""
    import torch

    import kvwire as kw
    from kvwire.generate import Engine
    from kvwire.generate.constrain import Constraint

    torch.set_num_threads(args.threads)
    lm = kw.load(args.model)
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a river."}], tokenize=True)
    results = {}
    for name, constrained in (("none", 0), ("half", args.clients // 2)):
        engine = Engine(lm, args.clients, 512)
        seqs = [engine.submit(ids, args.max_tokens, constraint=Constraint.json_schema(SCHEMA) if i < constrained
                              else None) for i in range(args.clients)]
        start = time.perf_counter()
        for _ in engine.run(seqs):
            pass
        results[name] = (engine, time.perf_counter() - start)
    engine, _ = results["half"]
    steps = max(engine.decode_steps, 1)
    mask_ms = 1000 * engine.mask_seconds / steps
    step_ms = 1000 * engine.decode_seconds / steps
    print(f"engine, {args.clients} rows ({args.clients // 2} constrained), {steps} decode steps: mask "
          f"{mask_ms:.2f} ms per step of {step_ms:.1f} ms ({mask_ms / step_ms:.1%}); vocabulary {lm.vocab_size}")
    plain = results["none"][0]
    print(f"engine step time, half constrained / none: {engine.decode_seconds / max(engine.decode_steps, 1):.4f} / "
          f"{plain.decode_seconds / max(plain.decode_steps, 1):.4f} s = "
          f"{(engine.decode_seconds / engine.decode_steps) / (plain.decode_seconds / plain.decode_steps):.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5, help="runs of each load, the best kept (run-to-run spread ~5%% at 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.max_tokens, args.requests_per_client, args.repeat = 2, 6, 1, 1
    print(header(args.threads))
    ratio, metrics = http_rows(args)
    engine_rows(args)
    if ratio is not None:
        print(f"goal: half json_schema >= 0.90x none constrained: {ratio:.3f}x -> {'met' if ratio >= 0.9 else 'NOT met'}")
        print(f"goal: metrics on >= 0.99x metrics off: {metrics:.3f}x -> {'met' if metrics >= 0.99 else 'NOT met'}")


if __name__ == "__main__":
    main()
