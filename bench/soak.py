"""Soak: does `kvwire serve` hold `--minutes` of mixed load with steady memory?

    python bench/soak.py [--minutes 30] [--clients 6] [--max-batch 4] [--model smollm2-135m-instruct]
                         [--max-length 1024] [--seed 0] [--threads 2] [--no-fill]

Starts `python -m kvwire.cli serve` as a child on a free 127.0.0.1 port with one random control
vector (`happy`, 0.1 * randn per block after the first, made here for the model's width), waits for /health,
fills the server's prefix store (distinct long prompts, 1.25 times its budget: it keeps finished
sequences' keys/values up to that budget, growth that is not a leak; `--no-fill` skips it), then
`--clients` threads (more than `--max-batch`, so requests queue) send, until the time is up, a random
mix of: chat and completion requests, streamed or not; greedy or sampled (temperature, top_p, seed);
max_tokens 1..64; prompts of 1 to ~300 words; multi-turn conversations (later turns should reuse
the cached prefix); `"steer": {"happy": s}`; stop strings; n=2 and two-prompt completions; streams
the client drops after a few events; and bad requests, which must get a 4xx in OpenAI's error
shape. Every answer is checked (status, shape, finish reasons, token counts, non-empty text where
a completion ran to its length, no stop string in the text) and failures are counted by kind.

Every 30 s it prints the server's RSS (/proc/PID/status VmRSS, and RssAnon: its own allocations
without mapped files), requests done and tokens/s over the interval; at the end the RSS after
warm-up (the first sample past minute 2 and 100 requests, at most half-way) against the end and
the max, growth per 10 minutes, and a verdict: "steady" when the growth from warm-up to the end is below 5 % of the
warm-up RSS or 50 MB, whichever is larger, else "GROWING". After the load stops, /health must show
no sequence running or waiting (a dropped stream that kept its slot would). The exit status is 1
when the server died (how: signal or exit code, and its stderr's tail), a check failed, or RSS grew.
"""
import argparse
import inspect
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from functools import partial

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from common import describe_exit, header  # noqa: E402
from serve_load import WORDS, Server  # noqa: E402

from kvwire.serve import create_app  # noqa: E402

QUESTIONS = ("How was your day?", "Tell me about rivers.", "What is a good name for a boat?",
             "Why do towns grow near rivers?", "Describe an old market.", "Write one line about spring.")
STOPS = (".", "\n", " the", "!")
EVERY_S = 30
# warm-up ends at the first sample past both: by then the prefix store has filled and the server has
# seen every kind of request. By the clock alone a slowed server is still warming up at minute 2
# (a run sharing the cores had served 34 requests then, and stepped up 107 MB at request ~55)
WARM_UP_MIN, WARM_UP_REQUESTS = 2, 100


class Stats:
    """Counts shared by the client threads (requests, tokens, errors by kind with a first example)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kinds, self.errors, self.examples = Counter(), Counter(), {}
        self.requests = self.tokens = self.server_errors = self.later_turns = self.reused = 0

    def done(self, kind, tokens=0):
        with self.lock:
            self.requests += 1
            self.kinds[kind] += 1
            self.tokens += tokens

    def error(self, kind, what, detail=""):
        with self.lock:
            self.requests += 1
            self.kinds[kind] += 1
            self.errors[f"{kind}: {what}"] += 1
            self.examples.setdefault(f"{kind}: {what}", detail[:300])
            self.server_errors += what.startswith("status 5")

    def turn(self, reused):
        with self.lock:
            self.later_turns += 1
            self.reused += reused


class Failed(Exception):
    """A check an answer failed: args (what, detail)."""


def words(rng, most):
    n = int(round(most ** rng.random()))  # log-uniform in 1..most: many short prompts, some long
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def draw_options(rng):
    """Sampling fields of one request: greedy or sampled, max_tokens, maybe stop strings and steer."""
    body = {"max_tokens": rng.randint(1, 64)}
    if rng.random() < 0.4:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.3, 1.2), 2)
        if rng.random() < 0.5:
            body["top_p"] = rng.choice([0.5, 0.9, 0.95])
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.25:
        body["stop"] = rng.choice(STOPS) if rng.random() < 0.5 else rng.sample(STOPS, 2)
    if rng.random() < 0.3:
        body["steer"] = {"happy": round(rng.uniform(-2.0, 2.0), 2)}
    return body


def check_choices(body, choices, usage, n):
    """Raise Failed when the choices or usage of an answer (whole or assembled from a stream) are wrong."""
    if len(choices) != n or sorted(choices) != list(range(n)):
        raise Failed("wrong choices", f"expected {n} choices, got indices {sorted(choices)}")
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", [])
    for text, reason in choices.values():
        if not isinstance(text, str) or reason not in ("stop", "length"):
            raise Failed("bad choice", f"text {text!r:.80}, finish_reason {reason!r}")
        if reason == "length" and not stops and not text:
            raise Failed("empty text", f"finish_reason length after {body['max_tokens']} tokens, text ''")
        if any(s in text for s in stops):
            raise Failed("stop string in text", f"stops {stops}, text {text!r:.120}")
    if usage is None:
        return
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int) or not n <= tokens <= n * body["max_tokens"]:
        raise Failed("bad usage", f"completion_tokens {tokens!r} for n={n}, max_tokens={body['max_tokens']}")
    if all(r == "length" for _, r in choices.values()) and tokens != n * body["max_tokens"]:
        raise Failed("bad usage", f"all choices hit length but completion_tokens {tokens} != {n} x {body['max_tokens']}")


def post_whole(client, path, body, n):
    """POST a non-streamed request; (choices {index: (text, finish_reason)}, usage)."""
    r = client.post(path, json=body)
    if r.status_code != 200:
        raise Failed(f"status {r.status_code}", r.text)
    obj = r.json()
    chat = path.endswith("chat/completions")
    if obj.get("object") != ("chat.completion" if chat else "text_completion"):
        raise Failed("bad shape", f"object {obj.get('object')!r}")
    choices = {}
    for c in obj["choices"]:
        text = c["message"]["content"] if chat else c["text"]
        if chat and c["message"].get("role") != "assistant":
            raise Failed("bad shape", f"message {c['message']!r:.120}")
        choices[c["index"]] = (text, c["finish_reason"])
    return choices, obj.get("usage")


def post_stream(client, path, body, drop_after=None):
    """POST a streamed request; (choices, usage or None). With drop_after, close after that many
    events and return None (the client went away)."""
    chat = path.endswith("chat/completions")
    want = "chat.completion.chunk" if chat else "text_completion"
    texts, reasons, usage, done, events = {}, {}, None, False, 0
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise Failed(f"status {r.status_code}", r.read().decode(errors="replace"))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if drop_after is not None and events >= drop_after:
                return None
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                raise Failed("error event", data)
            if obj.get("object") != want:
                raise Failed("bad shape", f"chunk object {obj.get('object')!r}")
            usage = obj.get("usage") or usage
            for c in obj["choices"]:
                piece = c.get("delta", {}).get("content", "") if chat else c.get("text", "")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                if c.get("finish_reason") is not None:
                    reasons[c["index"]] = c["finish_reason"]
    if drop_after is not None:
        return None  # finished before the client meant to leave
    if not done:
        raise Failed("no [DONE]", f"stream ended after {events} events")
    return {i: (texts.get(i, ""), reasons.get(i)) for i in set(texts) | set(reasons)}, usage


def ask(client, rng, path, body, n=1):
    """Send body streamed or whole, check it; (completion tokens, reply text of choice 0, cached tokens)."""
    stream = rng.random() < 0.5
    if stream:
        body = {**body, "stream": True}
        if rng.random() < 0.8:
            body["stream_options"] = {"include_usage": True}
        choices, usage = post_stream(client, path, body)
    else:
        choices, usage = post_whole(client, path, body, n)
    if not stream and usage is None:
        raise Failed("bad usage", "no usage in a whole answer")
    check_choices(body, choices, usage, n)
    tokens = usage["completion_tokens"] if usage else len(choices)  # without usage: at least one each
    cached = usage["prompt_tokens_details"]["cached_tokens"] if usage else None
    return tokens, choices[0][0], cached


def chat_request(client, rng, stats):
    body = {"messages": [{"role": "user", "content": f"{rng.choice(QUESTIONS)} {words(rng, 300)}"}],
            **draw_options(rng)}
    return ask(client, rng, "/v1/chat/completions", body)[0]


def completion_request(client, rng, stats):
    body = {"prompt": words(rng, 300), **draw_options(rng)}
    n = 1
    if rng.random() < 0.15:
        body["prompt"], n = [body["prompt"], words(rng, 40)], 2  # two prompts, one choice each
    elif rng.random() < 0.15:
        body["n"] = n = 2
    return ask(client, rng, "/v1/completions", body, n)[0]


def conversation(client, rng, stats):
    """2-4 turns with one sampler and steer throughout, so later turns can reuse the cached prefix."""
    options, messages, tokens = draw_options(rng), [], 0
    options.pop("stop", None)  # a reply cut at a stop is still a turn, but keep the history plain
    for turn in range(rng.randint(2, 4)):
        messages.append({"role": "user", "content": f"{rng.choice(QUESTIONS)} {words(rng, 60)}"})
        new, reply, cached = ask(client, rng, "/v1/chat/completions", {"messages": list(messages), **options})
        tokens += new
        if turn and cached is not None:
            stats.turn(cached > 0)
        messages.append({"role": "assistant", "content": reply})
    return tokens


def dropped_stream(client, rng, stats):
    """A streamed request the client leaves after 1-4 events, on its own connection."""
    body = {"prompt": words(rng, 100), "max_tokens": 64, "temperature": 0.8, "stream": True}
    with httpx.Client(base_url=client.base_url, timeout=client.timeout) as own:
        post_stream(own, "/v1/completions", body, drop_after=rng.randint(1, 4))
    return 0


def bad_request(client, rng, stats, max_length=1024):
    """One of several refusals; must be a 4xx with {"error": {"message": ...}}."""
    msgs = [{"role": "user", "content": "hi"}]
    cases = [("/v1/chat/completions", {"messages": msgs, "temperature": -1}),
             ("/v1/chat/completions", {"messages": msgs, "steer": {"sad": 1.0}}),
             ("/v1/chat/completions", {"messages": msgs, "model": "not-this-one"}),
             ("/v1/chat/completions", {"messages": msgs, "max_tokens": 0}),
             ("/v1/chat/completions", {"messages": []}),
             ("/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function"}]}),
             ("/v1/chat/completions", {"messages": msgs, "temperature": "0.5"}),
             ("/v1/chat/completions", {"max_tokens": 4}),
             ("/v1/completions", {"prompt": ""}),
             ("/v1/completions", {"prompt": "word " * max_length, "max_tokens": 4}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": max_length}),
             ("/v1/completions", {"prompt": "hi", "n": 17}),
             ("/v1/completions", {"prompt": "hi", "top_p": 0}),
             ("/v1/completions", b"{not json")]
    path, body = rng.choice(cases)
    r = client.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
        else client.post(path, json=body)
    if not 400 <= r.status_code < 500:
        raise Failed(f"status {r.status_code}, expected 4xx", f"{body!r:.100} -> {r.text}")
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if not isinstance(message, str) or not message:
        raise Failed("bad error shape", r.text)
    return 0


KINDS = [("chat", chat_request, 35), ("completion", completion_request, 30), ("conversation", conversation, 15),
         ("dropped stream", dropped_stream, 8), ("bad request", bad_request, 7)]


def client_loop(url, seed, deadline, stop, stats, max_length):
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as client:
        while time.time() < deadline and not stop.is_set():
            kind, fn, _ = rng.choices(KINDS, weights=[w for *_, w in KINDS])[0]
            fn = partial(bad_request, max_length=max_length) if fn is bad_request else fn
            try:
                stats.done(kind, fn(client, rng, stats))
            except Failed as e:
                stats.error(kind, *e.args)
            except httpx.TimeoutException as e:
                stats.error(kind, "timeout", repr(e))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                if stop.is_set():
                    return
                stats.error(kind, type(e).__name__, repr(e))


def rss_mb(pid, field="VmRSS"):
    """A process's resident memory in MB: VmRSS (all of it), or RssAnon (its own allocations: a
    leak shows here) / RssFile (mapped files: the weights cache, libraries' code as it is first run)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} for process {pid}")


def make_vector(model, path, seed):
    """Save the `happy` vector, 0.1 * randn(width) for every block of `model` but the first (llama.cpp's
    control-vector format, which `save` writes, numbers directions from 1); (width, blocks, bytes of
    keys/values a token takes in the server's prefix store, 0 when the config does not say)."""
    import torch

    import kvwire as kw

    lm = kw.load(model, progress=False)
    width, blocks = lm.head.weight.shape[1], len(kw.block_calls(lm.backbone))
    torch.manual_seed(seed)
    kw.ControlVector({i: torch.randn(width) * 0.1 for i in range(1, blocks)}).save(path)
    c = lm.config
    per_layer = 2 * getattr(c, "num_key_value_heads", 0) * getattr(c, "head_dim", 0) * lm.head.weight.element_size()
    return width, blocks, per_layer * getattr(c, "num_hidden_layers", 0)


def fill_store(url, token_bytes, budget, parallel, max_length, seed):
    """Send distinct long prompts (max_tokens 1) until their keys/values exceed the server's prefix
    store budget 1.25 times: the store, which keeps every finished sequence up to its budget, is
    then full, so its growth is not mistaken for a leak. (prompts, tokens); raises Failed on an error."""
    rng, lock, sent, failures = random.Random(seed), threading.Lock(), [0, 0], []

    def one(client):
        while not failures:
            with lock:
                if sent[1] * token_bytes > 1.25 * budget:
                    return
                prompt = f"{sent[0]} " + " ".join(rng.choice(WORDS) for _ in range(int(0.7 * max_length)))
                sent[0] += 1
            try:
                choices, usage = post_whole(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, 1)
            except (Failed, httpx.HTTPError) as e:
                failures.append(e)
                return
            with lock:
                sent[1] += usage["total_tokens"]

    with httpx.Client(base_url=url, timeout=600) as client:
        threads = [threading.Thread(target=one, args=(client,), daemon=True) for _ in range(parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failures:
        raise Failed("filling the prefix store failed", repr(failures[0]))
    return tuple(sent)


def tail(path, lines=30):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def health(url):
    try:
        r = httpx.get(f"{url}/health", timeout=10)
        return r.json() if r.status_code == 200 else {"status": f"HTTP {r.status_code}: {r.text[:200]}"}
    except httpx.HTTPError as e:
        return {"status": repr(e)}


def serve_argv(args, vector):
    return ["-m", "kvwire.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "{port}",
            "--max-batch", str(args.max_batch), "--max-length", str(args.max_length), "--control-vector",
            f"happy={vector}"]


def monitor(proc, url, stats, start, deadline, curve):
    """Every EVERY_S seconds, one line: minute, server RSS, requests done, tokens/s, errors, queue.
    Returns False when the server died."""
    last_t, last_tokens = start, 0
    print(f"{'minute':>7}{'RSS MB':>9}{'anon MB':>9}{'requests':>10}{'tokens/s':>10}{'errors':>8}{'running':>9}"
          f"{'waiting':>9}", flush=True)
    while True:
        wake = min(last_t + EVERY_S, deadline)
        while time.time() < wake:
            if proc.poll() is not None:
                return False
            time.sleep(min(1.0, max(0.0, wake - time.time())))
        now = time.time()
        rss, anon, h = rss_mb(proc.pid), rss_mb(proc.pid, "RssAnon"), health(url)
        with stats.lock:
            requests, tokens, errors = stats.requests, stats.tokens, sum(stats.errors.values())
        rate = (tokens - last_tokens) / max(1e-9, now - last_t)
        minute = (now - start) / 60
        curve.append((minute, rss, requests))
        print(f"{minute:7.1f}{rss:9.1f}{anon:9.1f}{requests:10d}{rate:10.1f}{errors:8d}{h.get('running', '-'):>9}"
              f"{h.get('waiting', '-'):>9}", flush=True)
        last_t, last_tokens = now, tokens
        if now >= deadline:
            return True


def verdict(curve, minutes):
    """(line, steady): RSS at the end of warm-up against the last sample. curve: (minute, RSS MB,
    requests done) samples. Warm-up ends at the first sample past WARM_UP_MIN minutes and
    WARM_UP_REQUESTS requests, or at the one nearest half-way if that comes later (half of what
    ran: an interrupted run's or a dead server's last sample is not its own baseline)."""
    half = min(minutes, curve[-1][0]) / 2
    warm = [c for c in curve if c[0] >= min(WARM_UP_MIN, half) and c[2] >= WARM_UP_REQUESTS]
    base = warm[0] if warm and warm[0][0] <= half else min(curve, key=lambda c: abs(c[0] - half))
    end, top = curve[-1], max(c[1] for c in curve)
    growth = end[1] - base[1]
    per10 = growth * 10 / max(1e-9, end[0] - base[0])
    limit = max(0.05 * base[1], 50.0)
    steady = growth < limit
    return (f"RSS {base[1]:.1f} MB at minute {base[0]:.1f} (after warm-up: {base[2]} requests) -> {end[1]:.1f} MB at minute {end[0]:.1f}, "
            f"max {top:.1f} MB: {growth:+.1f} MB ({growth / base[1]:+.1%}), {per10:+.1f} MB per 10 minutes\n"
            f"verdict: {'steady' if steady else 'GROWING'} (threshold: growth after warm-up < {limit:.1f} MB, "
            f"the larger of 5 % of {base[1]:.1f} MB and 50 MB)"), steady


def report(stats, elapsed):
    print(f"totals: {stats.requests} requests in {elapsed / 60:.1f} min ({stats.requests / elapsed:.2f}/s), "
          f"{stats.tokens} completion tokens ({stats.tokens / elapsed:.1f}/s)")
    print("requests by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(stats.kinds.items())))
    if stats.later_turns:
        print(f"prefix reuse: {stats.reused} of {stats.later_turns} later conversation turns had cached tokens")
    print(f"errors: {sum(stats.errors.values())}; unexpected 5xx: {stats.server_errors}")
    for what, count in sorted(stats.errors.items()):
        print(f"  {count:5d}  {what}  (first: {stats.examples[what]})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a preset or path with a chat template")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--clients", type=int, default=6, help="client threads (default 6; more than --max-batch)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=1024, help="the server's per-request context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads (OMP_NUM_THREADS)")
    p.add_argument("--no-fill", action="store_true", help="skip filling the prefix store before the load")
    args = p.parse_args()
    print(header(args.threads), flush=True)
    vector = os.path.join(tempfile.mkdtemp(prefix="kvwire-soak-"), "happy.gguf")
    width, blocks, token_bytes = make_vector(args.model, vector, args.seed)
    started = time.time()
    server = Server("kvwire-soak", serve_argv(args, vector), "/health", env={"OMP_NUM_THREADS": str(args.threads)})
    try:
        if not server.wait(timeout=600):
            return died(server)
        print(f"{args.model} served at {server.url} (pid {server.proc.pid}, up in {time.time() - started:.1f} s; "
              f"control vector happy: {blocks - 1} blocks x {width}); {args.clients} clients, max batch "
              f"{args.max_batch}, max length {args.max_length}, {args.minutes:g} min; server log {server.log.name}",
              flush=True)
        if token_bytes and not args.no_fill:
            filled = time.time()
            before = rss_mb(server.proc.pid)
            budget = inspect.signature(create_app).parameters["prefix_bytes"].default
            try:
                prompts, tokens = fill_store(server.url, token_bytes, budget, args.max_batch, args.max_length,
                                             args.seed)
            except Failed as e:
                print(*e.args, flush=True)
                return 1 if server.alive() else died(server)
            print(f"prefix store filled: {prompts} prompts, {tokens} tokens, {tokens * token_bytes / 1e6:.0f} MB of "
                  f"keys/values (budget {budget / 1e6:.0f} MB) in {time.time() - filled:.0f} s; server RSS "
                  f"{before:.1f} -> {rss_mb(server.proc.pid):.1f} MB", flush=True)
        return soak(server, args)
    finally:
        server.stop()  # also on Ctrl-C and exceptions


def soak(server, args):
    """The load, the RSS curve and the verdict; the exit status."""
    stats, curve, stop = Stats(), [], threading.Event()
    start = time.time()
    deadline = start + args.minutes * 60
    clients = [threading.Thread(target=client_loop, daemon=True, name=f"client-{i}",
                                args=(server.url, args.seed * 1000 + i, deadline, stop, stats, args.max_length))
               for i in range(args.clients)]
    for c in clients:
        c.start()
    try:
        alive = monitor(server.proc, server.url, stats, start, deadline, curve)
    except KeyboardInterrupt:  # the server got the Ctrl-C too: report what was measured
        stop.set()
        report(stats, time.time() - start)
        print("interrupted" + ("\n" + verdict(curve, args.minutes)[0] if len(curve) > 1 else ""))
        return 1
    stop.set()
    for c in clients:
        c.join(timeout=660)  # the last requests finish (the client timeout is 600 s)
    elapsed = time.time() - start
    if not alive or not server.alive():
        report(stats, elapsed)
        return died(server)
    idle = idle_after_load(server.url)
    report(stats, elapsed)
    print(f"after the load: {idle}")
    steady = True
    if len(curve) > 1:
        line, steady = verdict(curve, args.minutes)
        print(line)
    return 0 if steady and not stats.errors and idle.startswith("idle") else 1


def idle_after_load(url, wait_s=30):
    """"idle" once /health shows nothing running or waiting (within wait_s), else what it shows."""
    for _ in range(wait_s):
        h = health(url)
        if h.get("running") == 0 and h.get("waiting") == 0:
            return "idle (/health: 0 running, 0 waiting)"
        time.sleep(1)
    return f"NOT idle {wait_s} s after the last request: /health {h}"


def died(server):
    server.alive()  # sets server.failure, which keeps its log
    rc = server.proc.wait()
    how = describe_exit(rc, "") if rc else "exit status 0"
    server.log.flush()
    print(f"SERVER DIED: {how} (return code {rc}); the last lines of its log {server.log.name}:\n"
          f"{tail(server.log.name)}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
