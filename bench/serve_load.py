"""bench/serve.py's parts that know nothing of kvwire: OpenAI-compatible servers in child processes
(started on a free port, polled until ready, stopped, their peak RSS read) and the load generator
(concurrent streaming chat clients, time to first token, tokens per second)."""
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from common import describe_exit

PROMPTS = ["Tell me a short story about a lighthouse keeper.",
           "Explain why the sky is blue in simple words.",
           "Give me three tips for learning to cook.",
           "What is the difference between a lake and a pond?",
           "Write a few lines about autumn in a small town."]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI-compatible server in a child process on 127.0.0.1 (its output goes to a log file:
    a pipe nobody reads would block it).

    Example:
        >>> server = Server("llama.cpp", ["-m", "llama_cpp.server", "--model", path], "/v1/models")
        >>> if server.wait(timeout=300): ...   # else server.failure says why
        >>> server.stop()
    """

    def __init__(self, name, argv, ready_path, env=None):
        self.name, self.ready_path, self.port = name, ready_path, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-serve-{name}-", suffix=".log", delete=False)
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen([sys.executable, *argv], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.failure, self.model = "", None

    def wait(self, timeout):
        """True once `ready_path` answers 200 (and the served model's name is known); else False with
        `failure` saying why: the child's exit (its last log line) or the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return self._died()
            try:
                r = httpx.get(self.url + self.ready_path, timeout=5)
                if r.status_code == 200:
                    models = httpx.get(self.url + "/v1/models", timeout=5)
                    data = models.json().get("data") if models.status_code == 200 else None
                    self.model = data[0]["id"] if data else None
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.failure = f"not ready after {timeout} s (log: {self.log.name})"
        return False

    def alive(self):
        """True while the child runs; else False with `failure` set."""
        return self.proc.poll() is None or self._died()

    def _died(self):
        self.log.flush()
        with open(self.log.name) as f:
            self.failure = describe_exit(self.proc.returncode, f.read()) or "exited with status 0"
        return False

    def peak_rss_gb(self):
        """VmHWM of the child (NaN once it is gone or off Linux)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            return kb / 1e6
        except (OSError, StopIteration, ValueError):
            return float("nan")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not self.failure:  # kept when something went wrong: the failure names it
            os.unlink(self.log.name)


@dataclass
class Reply:
    """One streamed chat completion: seconds to its first text, completion tokens (usage's count,
    else the chunks with text), its text, finish reason, usage's cached_tokens (None: not reported)."""

    ttft: float = float("nan")
    tokens: int = 0
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str = ""


async def chat(client, model, messages, max_tokens, steer=None, extra=None):
    """Send one streaming greedy chat completion; never raises for the server's failures.
    steer: None, {name: strength} (named vectors) or a list of inline vectors (`steer_vectors`);
    extra: more body fields (e.g. {"response_format": ...})."""
    reply, chunks, start = Reply(), 0, time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model or "default", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={**(extra or {}), **({} if not steer else
            {"steer_vectors": steer} if isinstance(steer, list) else {"steer": steer})} or None)
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    if chunks == 0:
                        reply.ttft = time.perf_counter() - start
                    chunks += 1
                    reply.text += choice.delta.content
                reply.finish_reason = choice.finish_reason or reply.finish_reason
            if chunk.usage:
                reply.tokens, reply.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                reply.cached_tokens = details.cached_tokens if details else None
    except Exception as e:  # noqa: BLE001 - a failed request is a result to report
        reply.error = f"{type(e).__name__}: {e}"[:200]
    reply.tokens = reply.tokens or chunks
    return reply


@dataclass
class Load:
    """What `run_load` measured: every reply and the wall seconds from the first request to the last reply."""

    replies: list = field(default_factory=list)
    wall: float = float("nan")

    @property
    def ok(self):
        return [r for r in self.replies if not r.error]

    @property
    def tokens(self):
        return sum(r.tokens for r in self.ok)

    @property
    def tokens_per_s(self):
        return self.tokens / self.wall if self.ok else float("nan")

    @property
    def cached_share(self):
        """usage's cached_tokens / prompt_tokens over the replies (NaN when the server reports neither)."""
        pairs = [(r.cached_tokens, r.prompt_tokens) for r in self.ok if r.cached_tokens is not None and r.prompt_tokens]
        return sum(c for c, _ in pairs) / sum(p for _, p in pairs) if pairs else float("nan")

    def ttft(self, how):
        times = [r.ttft for r in self.ok if r.ttft == r.ttft]
        return how(times) if times else float("nan")

    def failure(self):
        """"" when every request succeeded, else how many failed and the first error."""
        bad = [r for r in self.replies if r.error]
        return f"{len(bad)} of {len(self.replies)} requests failed: {bad[0].error}" if bad else ""


def prompt_tokens(url, model, text):
    """usage.prompt_tokens of a one-token, non-streamed chat completion of `text` (None if not reported):
    both servers should render the same chat template."""
    body = {"model": model or "default", "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            "temperature": 0}
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    except httpx.HTTPError:  # a server that died: its rows say so
        return None
    return (r.json().get("usage") or {}).get("prompt_tokens") if r.status_code == 200 else None


def openai_client(url, timeout=600):
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=timeout)


async def _load(url, model, clients, requests, max_tokens, steer_of, extra_of=lambda k: None):
    async with openai_client(url) as client:
        async def one_client(c):
            out = []
            for j in range(requests):
                k = c * requests + j
                messages = [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]
                out.append(await chat(client, model, messages, max_tokens, steer_of(k), extra_of(k)))
            return out

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - start
    return Load([r for replies in per_client for r in replies], wall)


def run_load(url, model, clients, requests, max_tokens, steer_of=lambda k: None, extra_of=lambda k: None):
    """`clients` concurrent clients, each sending `requests` streaming chat completions one after the
    other (request k = client * requests + j gets PROMPTS[k % 5], steer_of(k) and the body fields
    extra_of(k)); a `Load`."""
    return asyncio.run(_load(url, model, clients, requests, max_tokens, steer_of, extra_of))


WORDS = ("river town market winter road garden teacher letter morning window harbor bridge mountain "
         "village story friend station forest summer evening school music kitchen bread lamp field "
         "cloud stone horse night farmer doctor library map boat island ship storm candle painter "
         "valley orchard mill clock tower baker chapel meadow").split()
VERBS = "walked watched found carried remembered opened painted crossed followed built wrote visited".split()


def long_text(words, seed):
    """About `words` words (~1.2 tokens each) of plain sentences, different for every seed."""
    rng = random.Random(seed)
    out = []
    while len(out) < words:
        n = rng.randint(6, 12)
        sentence = [rng.choice(WORDS) if i % 3 else rng.choice(VERBS) for i in range(n)]
        out += ["The", *sentence[:-1], sentence[-1] + "."]
    return f"Record {seed}. " + " ".join(out)


async def _prefix(url, model, words, repeats, first_seed, turn1_tokens=16, turn2_tokens=8):
    question, follow_up = "\n\nSummarise the text above in one sentence.", "Now give that summary a title."
    results = []
    async with openai_client(url) as client:
        for r in range(repeats):
            text = long_text(words, seed=first_seed + r)
            first = [{"role": "user", "content": text + question}]
            turn1 = await chat(client, model, first, turn1_tokens)
            if turn1.error:
                return [(turn1, turn1, turn1)]
            turn2 = first + [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": follow_up}]
            reused = await chat(client, model, turn2, turn2_tokens)
            # the same conversation but its first word: nothing past the template's head is shared
            other = [{"role": "user", "content": "Notes" + text.removeprefix("Record") + question}] + turn2[1:]
            fresh = await chat(client, model, other, turn2_tokens)
            results.append((turn1, reused, fresh))
    return results


def prefix_reuse(url, model, words, repeats, first_seed=1000):
    """[(turn 1, turn 2 reusing turn 1's prefix, turn 2 of a conversation whose first word differs)]
    as `Reply`s, one triple per repeat, each repeat on a text of its own (so nothing is cached from
    an earlier one; texts are seeded first_seed, first_seed + 1, ...: a warm-up takes others)."""
    return asyncio.run(_prefix(url, model, words, repeats, first_seed))


def median(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")
