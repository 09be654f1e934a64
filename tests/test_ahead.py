"""`lm.compile()`'s steps kept on disk (`kvwire.generate.ahead`): AOTInductor packages give eager's
tokens, are reused by models of the same structure with other weights and by a fresh process without
building anything, and a damaged or foreign package is named and rebuilt."""
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import kvwire as kw
from kvwire.generate import ahead
from kvwire.generate.ahead import AheadDecode, Package, signature
from kvwire.graph.digest import module_digest

from .conftest import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [torch.tensor([3, 17, 42, 9, 55]), torch.tensor([7, 8, 11])]


# Two layers where a test compiles: a package's build (~12 s of one core at two layers) grows by
# ~2 s a layer, and each mechanism here is the same on every layer.
LAYERS = 2


def _steered(seed):
    """Tiny Mistral (a window of 5 on every layer: ring caches) steered at block 1 with per-row
    strengths; the same structure for every seed, other vector values. Its greedy tokens depend on
    what the caches hold (a model repeating its last token would pass with caches never written)."""
    lm = kw.from_hf(FAMILIES["mistral"](num_hidden_layers=LAYERS))
    vec = kw.ControlVector({1: torch.randn(lm.head.weight.shape[1], generator=torch.Generator().manual_seed(seed))})
    return lm.steer(vec, torch.tensor([2.0, 0.5]))


def _greedy(lm, n=10):
    """Greedy tokens of both prompts (10: checked to be more than one repeated token per row)."""
    tokens = lm.generate(PROMPTS, max_new_tokens=n, ignore_eos=True, return_logprobs=True).tokens
    assert n < 10 or all(len(set(row)) > 1 for row in tokens), tokens
    return tokens


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One package folder for the module: the first test builds, the others load."""
    folder = tmp_path_factory.mktemp("kvwire_cache")
    before = os.environ.get("KVWIRE_CACHE")
    os.environ["KVWIRE_CACHE"] = str(folder)
    yield folder
    if before is None:
        del os.environ["KVWIRE_CACHE"]
    else:
        os.environ["KVWIRE_CACHE"] = before


def test_kept_steps_give_eager_tokens_and_serve_other_weights_of_the_same_structure(cache):
    lm = _steered(0)
    eager = _greedy(lm)
    lm.compile(bucket=32)
    tokens = _greedy(lm)
    decode = lm._decoder()
    assert isinstance(decode, AheadDecode) and decode.built == 2  # the decode step and the prompt chunks
    assert tokens == eager
    spans = sorted(r.span for r in decode.runners.values())
    assert spans[0] == [1, 1] and spans[1][0] <= len(PROMPTS[0]) <= spans[1][1]  # prompts ran compiled too
    assert len(list((cache / "steps").rglob("*.pt2"))) == 2

    other = _steered(1)  # other vector values: its own eager tokens, from the same packages
    other_eager = _greedy(other)
    assert other_eager != eager
    other.compile(bucket=32)
    assert _greedy(other) == other_eager and other._decoder().built == 0


CHILD = """
import json, sys, torch
torch.set_num_threads({threads})  # as this process: a reduction's order may follow the thread count
sys.path.insert(0, {root!r})
from tests.test_ahead import _steered, _greedy, PROMPTS
lm = _steered(0).compile(bucket=32)
tokens = _greedy(lm)
decode = lm._decoder()
cache = lm.cached.init_cache(2, 32)
logits, _ = decode(torch.tensor([[5], [6]]), torch.tensor([[0], [0]]), torch.tensor(0),
                   torch.ones(2, 32, dtype=torch.bool), cache, tuple(lm.cached.default_inputs(2).values()))
print(json.dumps({{"built": decode.built, "tokens": tokens, "logits": logits.tolist()}}))
"""


def test_a_fresh_process_loads_the_packages_and_computes_what_this_process_compiled(cache):
    lm = _steered(0).compile(bucket=32)
    tokens = _greedy(lm)
    decode = lm._decoder()
    c = lm.cached.init_cache(2, 32)
    logits, _ = decode(torch.tensor([[5], [6]]), torch.tensor([[0], [0]]), torch.tensor(0),
                       torch.ones(2, 32, dtype=torch.bool), c, tuple(lm.cached.default_inputs(2).values()))
    child = CHILD.format(root=str(ROOT), threads=torch.get_num_threads())
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         env={**os.environ, "KVWIRE_CACHE": str(cache)}, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["built"] == 0  # loaded, not traced or compiled
    assert child["tokens"] == tokens
    assert torch.equal(torch.tensor(child["logits"]), logits)  # the same program, bit for bit


def _one_package(cache):
    lm = _steered(0).compile(bucket=32)
    _greedy(lm, 2)
    decode = lm._decoder()
    [package] = [p for p in decode.runners.values() if p.span == [1, 1]]
    path = next(p for p in (cache / "steps" / decode.key).glob("*.pt2")
                if json.loads(p.with_suffix(".json").read_text())["span"] == [1, 1])
    return decode, package.signature, path


def test_a_package_from_another_torch_or_cpu_is_not_used(cache):
    decode, sig, path = _one_package(cache)
    assert Package.open(path, decode.key, sig, decode.program) is not None
    record = path.with_suffix(".json")
    meta = json.loads(record.read_text())
    try:
        record.write_text(json.dumps({**meta, "machine": ["1.0", "GenuineIntel", "other", "avx2+"]}))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # silently: a package made elsewhere is simply built anew
            assert Package.open(path, decode.key, sig, decode.program) is None
    finally:
        record.write_text(json.dumps(meta))


def test_a_damaged_package_is_named_and_rebuilt(cache):
    decode, sig, path = _one_package(cache)
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\0" * 64
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=rf"{path.name}.*do not match the digest"):
        assert Package.open(path, decode.key, sig, decode.program) is None
    lm = _steered(0)
    eager = _greedy(lm)
    lm.compile(bucket=32)
    with pytest.warns(UserWarning, match=path.name):
        assert _greedy(lm) == eager
    assert lm._decoder().built == 1  # the damaged one only
    assert Package.open(path, decode.key, sig, decode.program) is not None


def test_a_record_that_does_not_read_is_named(cache):
    decode, sig, path = _one_package(cache)
    record = path.with_suffix(".json")
    meta = record.read_text()
    try:
        record.write_text("{not json")
        with pytest.warns(UserWarning, match=rf"{record.name}.*does not read"):
            assert Package.open(path, decode.key, sig, decode.program) is None
    finally:
        record.write_text(meta)


def test_the_digest_follows_structure_not_values():
    a, b = kw.from_hf(FAMILIES["llama"](seed=0)), kw.from_hf(FAMILIES["llama"](seed=1))
    assert module_digest(a.backbone) == module_digest(b.backbone)  # other weights
    v = torch.ones(a.head.weight.shape[1])
    added = a.edit(lambda layer, x: layer(x) + v if layer is a.backbone.layers[1] else layer(x))
    scaled = a.edit(lambda layer, x: layer(x) * v if layer is a.backbone.layers[1] else layer(x))
    assert module_digest(added.cached.graph_module) != module_digest(a.cached.graph_module)
    assert module_digest(added.cached.graph_module) != module_digest(scaled.cached.graph_module)  # code alone
    wider = kw.from_hf(FAMILIES["llama"](intermediate_size=96))
    assert module_digest(wider.backbone) != module_digest(a.backbone)
    # save a tensor a compiler writes into its code by value (0-d, or 1-d of at most 8)
    small, long = torch.nn.Module(), torch.nn.Module()
    small.register_buffer("s", torch.tensor(2.0))
    long.register_buffer("s", torch.ones(16))
    before = module_digest(small), module_digest(long)
    small.s.fill_(0.5)
    long.s.fill_(0.5)
    assert module_digest(small) != before[0] and module_digest(long) == before[1]


def test_a_scale_written_into_the_compiled_code_keys_its_package(tmp_path, monkeypatch):
    """A 0-d tensor is compiled in by value: a model scaling by another value builds its own step
    (sharing the package would give the first model's tokens)."""
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    base = kw.from_hf(FAMILIES["llama"](num_hidden_layers=LAYERS))

    def scaled(value):
        s = torch.tensor(value)
        return base.edit(lambda layer, x: layer(x) * s if layer is base.backbone.layers[1] else layer(x))

    ids = torch.tensor([3, 17, 42, 9, 55])
    runs = []
    for value in (3.0, -2.0):
        lm = scaled(value)
        eager = lm.generate(ids, max_new_tokens=8, ignore_eos=True).tolist()
        lm.compile(bucket=32, prefill_tokens=0)
        runs.append((eager, lm.generate(ids, max_new_tokens=8, ignore_eos=True).tolist(), lm._decoder().built))
    (eager_a, compiled_a, built_a), (eager_b, compiled_b, built_b) = runs
    assert eager_a != eager_b and compiled_a == eager_a and compiled_b == eager_b
    assert built_a == built_b == 1


def test_the_signature_leaves_a_chunks_length_out():
    flat = [torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), torch.tensor(0)]
    shorter = [torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.tensor(0)]
    assert signature(flat, True) == signature(shorter, True)
    assert signature(flat, False) != signature(shorter, False)


def test_compile_refuses_ahead_settings_it_cannot_honour():
    lm = kw.from_hf(FAMILIES["llama"]())
    with pytest.raises(ValueError, match="ahead=True .* takes no torch.compile options.*'mode'"):
        lm.compile(ahead=True, mode="max-autotune")
    with pytest.raises(ValueError, match="ahead must be True, False or None.*'yes'"):
        lm.compile(ahead="yes")
    with pytest.raises(ValueError, match="background=True builds steps ahead of time .*needs ahead"):
        lm.compile(ahead=False, background=True)
    with pytest.raises(ValueError, match="background must be True or False, got 1"):
        lm.compile(background=1)
    assert lm.compile()._compile_options["ahead"] is True  # the default on a CPU model
    assert lm.compile(mode="max-autotune")._compile_options["ahead"] is False


def test_a_cache_folder_that_cannot_be_written_still_compiles(tmp_path, monkeypatch):
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("")
    monkeypatch.setenv("KVWIRE_CACHE", str(blocked))  # steps/ cannot be made under a file
    lm = kw.from_hf(FAMILIES["mistral"](num_hidden_layers=LAYERS))
    eager = lm.generate(PROMPTS[:1], max_new_tokens=8, ignore_eos=True, return_logprobs=True).tokens
    lm.compile(bucket=32, prefill_tokens=0)
    with pytest.warns(UserWarning, match=r"cannot keep compiled steps in .*not_a_folder"):
        tokens = lm.generate(PROMPTS[:1], max_new_tokens=8, ignore_eos=True, return_logprobs=True).tokens
    assert tokens == eager and lm._decoder().built == 1


def test_an_engine_on_kept_steps_grows_its_timeline_and_steps_over_the_occupied_rows(tmp_path, monkeypatch):
    from kvwire.generate import engine as engine_module

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    monkeypatch.setattr(engine_module, "GROW_FROM", 32)  # the timeline grows within a short test
    lm = kw.from_hf(FAMILIES["mistral"](num_hidden_layers=LAYERS))
    prompts, lengths = [p.tolist() for p in PROMPTS], (40, 12)
    alone = [lm.generate(torch.tensor(p), max_new_tokens=n, ignore_eos=True).tolist() for p, n in zip(prompts, lengths)]
    lm.compile(bucket=32)
    engine = kw.Engine(lm, max_batch=4, max_length=128, grow=True)
    a = engine.submit(prompts[0], lengths[0])  # prefilled alone into its row: compiled (a group of 1)
    for _ in range(30):  # alone in row 0 (the timeline grown past 32 positions to hold its 45)
        engine.step()
    b = engine.submit(prompts[1], lengths[1])  # joins while a decodes
    for _ in engine.run([a, b]):
        pass
    assert [a.tokens, b.tokens] == alone
    assert engine.stats["timeline_grown"] >= 1
    runners = lm._decoder().runners.values()
    used = {(p.signature[2][0][0], p.signature[5][0][1]) for p in runners if not p.signature[0]}  # (batch, timeline)
    assert {(1, 64), (2, 64)} <= used and all(batch < 4 for batch, _ in used)
    assert [(p.signature[2][0][0], p.signature[5][0][1]) for p in runners if p.signature[0]] == [(1, 64)]  # a's prompt


def test_a_server_of_a_compiled_model_decodes_on_kept_steps(tmp_path, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from kvwire.serve import create_app

    from .serve_fixtures import Server, tiny_chat_lm

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    hello = [{"role": "user", "content": "Hello there, how are you?"}]
    lm = tiny_chat_lm(num_hidden_layers=LAYERS)
    expected = lm.chat(hello, max_new_tokens=8, reuse_prefix=False)
    # as `kvwire serve --compile`: the first request is answered (eager) while a child builds its decode
    # step (prompts eager here: a prompt chunk's step builds in a child as a decode step does, and
    # prompt steps serve in the engine's test above)
    server = Server(create_app(lm.compile(prefill_tokens=0, background=True), "tiny", max_batch=2, max_length=256))
    records = lambda: list((tmp_path / "steps").rglob("*.json"))  # noqa: E731
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=hello, temperature=0, max_tokens=8)
        assert not records()  # answered before the step was compiled
        deadline = time.monotonic() + 300
        while not records() and time.monotonic() < deadline:
            time.sleep(0.5)
        reply = client.chat.completions.create(model="tiny", messages=hello, temperature=0, max_tokens=8)
    finally:
        server.close()
    assert first.choices[0].message.content == reply.choices[0].message.content == expected
    built = [json.loads(p.read_text())["signature"] for p in records()]
    # the served (steered) copy decoded one row, compiled
    assert [(s[0], s[2][0][0]) for s in built] == [(False, 1)]


def test_serve_compile_compiles_the_loaded_model(tmp_path):
    from kvwire.cli import parser
    from kvwire.cli.serve import load_served

    from .conftest import tiny_hf_gpt2
    from .gguf_files import write_gpt2

    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300))
    args = parser().parse_args(["serve", "--model", str(tmp_path / "g.gguf"), "--quantize", "none", "--compile"])
    settings = load_served(args, "none").compile_settings
    assert settings["ahead"] is True and settings["background"] is True  # steps build beside serving
    args = parser().parse_args(["serve", "--model", str(tmp_path / "g.gguf"), "--quantize", "none"])
    assert load_served(args, "none").compile_settings is None


def test_a_decode_step_export_cannot_make_runs_eager_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = kw.from_hf(FAMILIES["mistral"]())
    eager = _greedy(lm)

    def refuse(*args, **kwargs):
        raise RuntimeError("data-dependent branch\nmore detail")

    monkeypatch.setattr(torch.export, "export", refuse)
    lm.compile(bucket=32, prefill_tokens=0)
    with pytest.warns(UserWarning, match=r"decode step cannot be exported .*RuntimeError: data-dependent branch\);"
                                         r" it runs eager \(lm.compile\(ahead=False\)"):
        assert _greedy(lm) == eager
    assert lm._decoder().built == 0 and not list(tmp_path.rglob("*.pt2"))


def test_a_thread_writing_a_buffer_while_a_step_is_traced_writes_the_real_one(tmp_path, monkeypatch):
    # a server lends inline steering slots on its handler threads (a vector written into a buffer)
    # while the engine thread may be exporting a step: export puts fake tensors into the modules it
    # traces, so a write landing then must still reach the model's own buffer
    import threading

    from kvwire.serve.inline import InlineBank, SlotSteer

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = kw.from_hf(FAMILIES["mistral"](num_hidden_layers=LAYERS))
    bank = InlineBank(lm, slots=2)
    lm = bank.apply(lm).compile(bucket=32, prefill_tokens=0)
    layer = next(iter(bank.layers.values()))
    tracing, written, seen = threading.Event(), threading.Event(), {}
    export, act = torch.export.export, SlotSteer.act

    def paused_act(self, *args, **kwargs):  # inside the trace: let the other thread write now
        tracing.set()
        written.wait(60)
        return act(self, *args, **kwargs)

    def exporting(*args, **kwargs):
        monkeypatch.setattr(SlotSteer, "act", paused_act)
        try:
            return export(*args, **kwargs)
        finally:
            monkeypatch.setattr(SlotSteer, "act", act)

    def lend():
        tracing.wait(60)
        seen["type"] = type(layer.directions)
        layer.directions[0].copy_(torch.ones(layer.directions.shape[1]))
        written.set()

    monkeypatch.setattr(torch.export, "export", exporting)
    thread = threading.Thread(target=lend)
    thread.start()
    lm.generate(PROMPTS[:1], max_new_tokens=2, ignore_eos=True)
    thread.join()
    assert tracing.is_set() and seen["type"] is torch.Tensor  # not export's fake tensor
    assert torch.equal(layer.directions[0], torch.ones(layer.directions.shape[1]))  # the write was kept
    assert lm._decoder().built == 1


def _generic_compiled(tmp_path, monkeypatch):
    """(tiny generic llama compiled ahead with kept steps in tmp_path, its eager tokens)."""
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = kw.from_hf(FAMILIES["llama"](num_hidden_layers=LAYERS), generic=True)
    eager = [t.tolist() for t in lm.generate(PROMPTS[:1], max_new_tokens=4, ignore_eos=True)]
    return lm.compile(bucket=32, prefill_tokens=0), eager


def test_a_generic_model_s_decode_step_is_built(tmp_path, monkeypatch):
    # the generic path reaches transformers' modules through plain attributes (the layer's attention,
    # the base model's embedding and rotary tables) and finds its attention by identity while traced:
    # the shell a step is exported from keeps both true, so the step compiles with the embedding as
    # the program's own weight, not a constant the package could not be handed
    lm, eager = _generic_compiled(tmp_path, monkeypatch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(cannot be exported|cannot be compiled).*")
        assert [t.tolist() for t in lm.generate(PROMPTS[:1], max_new_tokens=4, ignore_eos=True)] == eager
    assert lm._decoder().built == 1


def test_a_step_whose_package_names_a_tensor_the_model_lacks_runs_eager_and_says_why(tmp_path, monkeypatch):
    # what a trace that made tensors of its own would leave: a package naming a constant the model
    # does not hold; it is removed, the step runs eager and the warning names the tensor
    import kvwire.generate.ahead as ahead

    lm = _steered(0)
    eager = [t.tolist() for t in lm.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)]
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm.compile(bucket=32, prefill_tokens=0)
    resolve = ahead._tensor_of
    monkeypatch.setattr(ahead, "_tensor_of", lambda program, name: None if name.endswith("head.weight") or
                        name.endswith("output.weight") else resolve(program, name))
    with pytest.warns(UserWarning, match="cannot be compiled ahead of time .*not the model's"):
        assert [t.tolist() for t in lm.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)] == eager
    assert not list(tmp_path.rglob("*.pt2")) and list(lm._decoder().runners.values()) == [ahead.EAGER]


def test_a_kept_package_naming_a_tensor_the_model_lacks_is_rebuilt_not_raised(cache, tmp_path, monkeypatch):
    # a package already on disk that names a constant the model does not hold: a later process
    # names it and builds again (here the build meets the same tensor and runs eager), no exception
    import kvwire.generate.ahead as ahead

    _greedy(_steered(0).compile(bucket=32), 2)  # the module's packages (loaded, or built if none yet)
    shutil.copytree(cache / "steps", tmp_path / "steps")  # a copy: the module's stay whole
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = _steered(0)
    eager = [t.tolist() for t in lm.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)]
    assert list(tmp_path.rglob("*.pt2"))
    later = _steered(0).compile(bucket=32, prefill_tokens=0)
    resolve = ahead._tensor_of
    monkeypatch.setattr(ahead, "_tensor_of", lambda program, name: None if name.endswith("head.weight") or
                        name.endswith("output.weight") else resolve(program, name))
    with pytest.warns(UserWarning, match="is not used: .*not the model's"):
        assert [t.tolist() for t in later.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)] == eager


@pytest.mark.parametrize("family", ["gemma3", "granite"])
def test_a_model_with_an_embedding_scale_builds_its_step_ahead(tmp_path, monkeypatch, family):
    """Gemma's sqrt(hidden) embedding scale, Granite's embedding multiplier: a tensor made in the
    embedding's forward was a constant of the exported graph that is not the model's, so the step
    ran eager (with a warning) in every process."""
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = kw.from_hf(FAMILIES[family](num_hidden_layers=LAYERS))
    assert lm.backbone.embed_tokens.scale not in (None, 1.0)

    def run():  # a tiny random model may repeat its token: its log-probs say what the caches held
        return lm.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, return_logprobs=True)

    eager = run()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kvwire:")  # "cannot be compiled ahead of time" fails here
        lm.compile(bucket=32, prefill_tokens=0)
        compiled = run()
    assert isinstance(lm._decoder(), AheadDecode) and lm._decoder().built == 1
    assert compiled.tokens == eager.tokens
    torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs), rtol=0, atol=1e-5)


def test_one_token_slices_of_prompts_of_any_length_share_one_step(tmp_path, monkeypatch):
    """`ids[:, -1:]` of a one-row prompt counts as contiguous yet keeps the prompt's row stride:
    the step's key must not see it, or every prompt length builds a step of its own."""
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    lm = kw.from_hf(FAMILIES["llama"]()).compile(bucket=32)
    decode, met = lm._decoder(), []
    monkeypatch.setattr(decode, "_runner", lambda sig, flat: met.append(sig) or ahead.EAGER)
    cache, extra = lm.cached.init_cache(1, 32), tuple(lm.cached.default_inputs(1).values())
    logits = []
    for length in (1, 5, 9):
        ids = torch.arange(3, 3 + length).view(1, length)[:, -1:].fill_(7)
        assert ids.stride() == (length, 1)
        positions = torch.arange(length).view(1, length)[:, -1:].fill_(0)
        out, _ = decode(ids, positions, torch.tensor(0), torch.ones(1, 32, dtype=torch.bool), cache, extra)
        logits.append(out)
    assert len(met) == 1 and met[0][2][1] == [1, 1]  # one signature, row-major strides
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
