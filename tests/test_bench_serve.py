"""bench/serve_load.py against a fake OpenAI-compatible server in this process (no model, no
llama.cpp): what the load generator sends and counts, how a failing request and a server that
dies or never comes up are reported."""
import asyncio
import json
import os
import sys
import threading
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import serve_load  # noqa: E402

pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

TOKENS = ["Once", " upon", " a", " time", "."]


def fake_app(bodies):
    """Streams one word per chunk after 20 ms each (a role chunk first, usage last, as kvwire does);
    a message containing "fail" gets a 500."""

    async def chat(request):
        body = await request.json()
        bodies.append(body)
        if "fail" in body["messages"][-1]["content"]:
            return JSONResponse({"error": {"message": "engine stopped", "type": "server_error"}}, status_code=500)
        n = min(body["max_tokens"], len(TOKENS))
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}

        async def events():
            yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                    "content": ""}}]}) + "\n\n"
            for word in TOKENS[:n]:
                await asyncio.sleep(0.02)
                yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"content": word}}]}) + "\n\n"
            yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) \
                + "\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n,
                     "prompt_tokens_details": {"cached_tokens": 3}}
            yield "data: " + json.dumps({**head, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def fake():
    bodies = []
    port = serve_load.free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(bodies), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", bodies
    server.should_exit = True
    thread.join(5)


def test_load_counts_usage_tokens_and_sends_steer_to_half(fake):
    url, bodies = fake
    bodies.clear()
    load = serve_load.run_load(url, "fake", clients=3, requests=2, max_tokens=4,
                               steer_of=lambda k: {"happy": 0.8} if k % 2 == 0 else None)
    assert load.failure() == "" and len(load.replies) == 6
    assert load.tokens == 6 * 4 and load.tokens_per_s == pytest.approx(24 / load.wall)
    # the first text comes after one 20 ms chunk, not with the empty role chunk
    assert all(0.015 < r.ttft < load.wall for r in load.replies)
    assert all(r.text == "Once upon a time" and r.cached_tokens == 3 for r in load.replies)
    assert sorted(b.get("steer") is not None for b in bodies) == [False] * 3 + [True] * 3
    assert all(b["stream"] and b["temperature"] == 0 and b["max_tokens"] == 4 for b in bodies)
    assert {b["messages"][0]["content"] for b in bodies} == set(serve_load.PROMPTS[:5])
    bodies.clear()
    inline = [{"directions": {"1": "AAAA"}, "strength": 0.5}]
    serve_load.run_load(url, "fake", clients=1, requests=2, max_tokens=2, steer_of=lambda k: inline)
    assert [b.get("steer_vectors") for b in bodies] == [inline, inline]
    bodies.clear()
    fmt = {"response_format": {"type": "json_object"}}
    serve_load.run_load(url, "fake", clients=1, requests=2, max_tokens=2, steer_of=lambda k: {"happy": 1.0},
                        extra_of=lambda k: fmt if k == 0 else None)
    assert [b.get("response_format") for b in bodies] == [fmt["response_format"], None]
    assert all(b["steer"] == {"happy": 1.0} for b in bodies)


def test_a_failing_request_is_reported_and_left_out(fake, monkeypatch):
    url, _ = fake
    monkeypatch.setattr(serve_load, "PROMPTS", ["please fail", "hello"])
    load = serve_load.run_load(url, "fake", clients=2, requests=1, max_tokens=5)
    assert load.failure().startswith("1 of 2 requests failed: InternalServerError")
    assert load.tokens == 5 and len(load.ok) == 1


def test_prefix_turns_share_the_first_turn_and_fresh_differs_in_its_first_word(fake):
    url, bodies = fake
    bodies.clear()
    (turn1, reused, fresh), = serve_load.prefix_reuse(url, "fake", words=50, repeats=1)
    first, second, third = (b["messages"] for b in bodies)
    assert second[:1] == first and second[1] == {"role": "assistant", "content": turn1.text}
    assert third[1:] == second[1:] and third[0] != first[0]
    assert third[0]["content"].split()[1:] == first[0]["content"].split()[1:]
    assert turn1.tokens == 5 and reused.tokens == fresh.tokens == 5


def test_a_server_that_crashes_or_never_answers_says_why():
    crashed = serve_load.Server("crashes", ["-c", "raise RuntimeError('weights do not fit')"], "/health")
    assert not crashed.wait(timeout=30)
    assert crashed.failure == "RuntimeError: weights do not fit" and not crashed.alive()
    crashed.stop()
    os.unlink(crashed.log.name)  # kept by stop() for a server that failed
    silent = serve_load.Server("silent", ["-c", "import time; time.sleep(60)"], "/health")
    try:
        assert not silent.wait(timeout=1) and silent.failure.startswith("not ready after 1 s")
        assert silent.alive() and silent.peak_rss_gb() > 0
    finally:
        silent.stop()
        os.unlink(silent.log.name)
    assert silent.proc.returncode is not None


def test_goal_lines_say_met_not_met_and_why_not_measured(capsys):
    import serve

    fast, slow = (serve_load.Load([serve_load.Reply(ttft=0.1, tokens=n)], wall=1.0) for n in (10, 8))
    near = serve_load.Load([serve_load.Reply(ttft=0.1, tokens=19)], wall=2.0)
    loads = {("kvwire", 16): fast, ("llama.cpp", 16): slow, ("kvwire +happy (half steered)", 16): slow,
             ("kvwire +happy (each inline)", 16): near, ("kvwire +happy (none steered)", 16): fast}
    serve.goals(loads, {}, {"kvwire": "died during the 16-client run: killed by SIGSEGV"}, 16)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("kvwire 10.0 / llama.cpp 8.0 tokens/s = 1.25x (goal >= 1.0x): met")
    assert lines[1].endswith("1 - 8.0 / 10.0 tokens/s (no control vector) = 20.0% (goal < 10 %): NOT met")
    assert lines[2].endswith("1 - 9.5 / 10.0 tokens/s (none steered) = 5.0% (goal <= 10 %): met")
    assert lines[3] == "goal: prefix reuse, turn-2 TTFT: not measured (died during the 16-client run: killed by SIGSEGV)"


def test_soak_warm_up_ends_past_minute_two_and_a_hundred_requests():
    import soak

    # a slowed server: 44 requests at minute 2, a 107 MB step at minute 5, flat after it
    slow = [(m / 2, 1550.0 if m < 10 else 1657.0, 11 * m) for m in range(1, 61)]
    line, steady = soak.verdict(slow, 30)
    assert steady and "at minute 5.0 (after warm-up: 110 requests)" in line
    quiet = [(m / 2, 1600.0 + m, 70 * m) for m in range(1, 61)]
    assert "at minute 2.0 (after warm-up: 280 requests)" in soak.verdict(quiet, 30)[0]
    stalled = [(m / 2, 1600.0 + 10 * m, 1) for m in range(1, 61)]  # never warms up: half-way
    line, steady = soak.verdict(stalled, 30)
    assert not steady and "at minute 15.0" in line
    line, steady = soak.verdict(stalled[:20], 30)  # interrupted at minute 10: half of what ran
    assert not steady and "at minute 5.0" in line


def test_the_bench_passes_the_compile_choice_and_warms_what_the_server_compiles(monkeypatch):
    import serve

    monkeypatch.setattr(serve, "auto_weights", lambda model: "gguf")
    argv = lambda args: serve.servers_to_start(args, "m.gguf", "happy.gguf")["kvwire"][0]  # noqa: E731
    default, on, off = (serve.resolve(serve.parser().parse_args(["--skip-peer", *flag]), serve.parser())
                        for flag in ([], ["--compile"], ["--no-compile"]))
    assert "--compile" not in argv(default) and "--no-compile" not in argv(default) and serve.compiled(default)
    assert "--compile" in argv(on) and serve.compiled(on)
    assert "--no-compile" in argv(off) and not serve.compiled(off)
    auto = serve.resolve(serve.parser().parse_args(["--quantize", "auto"]), serve.parser())  # the server's pick
    assert serve.compiled(auto)
    monkeypatch.setattr(serve, "auto_weights", lambda model: "float32")
    assert not serve.compiled(default) and not serve.compiled(serve.resolve(serve.parser().parse_args(
        ["--quantize", "none"]), serve.parser()))
