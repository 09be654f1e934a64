"""The server's gate between engine steps and the analysis endpoints (`kvwire.serve.bridge.Gate`):
an analysis holding the engine gives it turns between its batches, so decoding goes on while an
evaluation, a patching sweep or a capture runs; the two never run at once, and an idle engine costs
the analysis nothing."""
import threading
import time

import pytest
import torch

from kvwire.serve.bridge import Gate
from kvwire.steer.turns import taking_turns, turn

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvwire.serve import create_app  # noqa: E402

from .serve_fixtures import Server, tiny_chat_lm  # noqa: E402


def _engine(gate, holding, steps, overlaps, stop):
    while not stop.is_set():
        gate.checkpoint()
        if holding[0]:
            overlaps.append(steps[0])
        steps[0] += 1
        time.sleep(0.001)  # a step
    gate.engine_stopped()


@pytest.mark.parametrize("busy", [True, False])
def test_a_holder_taking_turns_lets_a_busy_engine_step_and_never_overlaps_it(busy):
    gate = Gate(busy=lambda: busy)
    holding, steps, overlaps, stop = [False], [0], [], threading.Event()
    engine = threading.Thread(target=_engine, args=(gate, holding, steps, overlaps, stop))
    engine.start()
    try:
        stepped = []
        with gate.exclusive():
            holding[0] = True
            for _ in range(5):
                time.sleep(0.003)  # a batch
                before = steps[0]
                holding[0] = False
                turn_started = time.monotonic()
                gate.turn()
                took = time.monotonic() - turn_started
                holding[0] = True
                stepped.append(steps[0] - before)
            holding[0] = False
        assert not overlaps  # no step while the holder held the engine
        if busy:
            assert all(n >= 1 for n in stepped), stepped  # every turn: at least one step
            assert took < 0.5
        else:
            assert stepped == [0] * 5  # nothing to do: the turn returns at once, no step
    finally:
        stop.set()
        engine.join(10)


def test_turns_are_for_the_holder_and_nothing_outside_taking_turns():
    gate = Gate(busy=lambda: True)
    with pytest.raises(RuntimeError, match="inside exclusive"):
        gate.turn()
    called = []
    turn()  # outside `taking_turns`: nothing
    with taking_turns(lambda: called.append(1)):
        turn()
    assert called == [1]


def test_the_engine_decodes_between_the_batches_of_a_capture():
    """A long generation is running when a capture of 20 prompts (3 batches of 8) comes in: the
    capture's two turns each let the engine step, and the capture equals one made on an idle server."""
    lm = tiny_chat_lm(context=2048)
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=2048, playground=False))
    try:
        served = server.app.state.served
        gate, engine = served.bridge.gate, served.bridge.engine
        steps, turns = [0], []
        step, give = engine.step, gate.turn

        def counted():
            steps[0] += 1
            return step()

        def counted_turn():
            before = steps[0]
            give()
            turns.append(steps[0] - before)

        engine.step, gate.turn = counted, counted_turn
        body = {"input": [f"prompt number {i}" for i in range(20)], "layers": [1], "encoding_format": "float"}
        with httpx.Client(base_url=server.url, timeout=120) as api:
            alone = api.post("/kvwire/capture", json=body).json()
            assert turns == [0, 0]  # an idle engine: no steps in the turns
            seq = engine.submit(list(range(3, 40)), 1900)  # no stop ids: ~1900 decode steps
            while steps[0] < 3:
                time.sleep(0.01)
            turns.clear()
            busy = api.post("/kvwire/capture", json=body).json()
            assert not seq.done, "the generation ended before the capture; it must outlast it"
        assert len(turns) == 2 and all(n >= 1 for n in turns), turns
        assert busy["data"] == alone["data"]
        seq.cancel()
    finally:
        server.close()
