"""`lm.compile(ahead=False)` (torch.compile in the process; the default kept steps: test_ahead.py): the
compiled decode step and short prompts give eager's tokens, batches and
steering included, and calls with different lengths share one compiled step."""
import os
import re

import pytest
import torch

import kvwire as kw
from kvwire.generate.compiled import _compiled_graphs as _graphs  # graphs dynamo compiled so far

from .conftest import FAMILIES


# Two layers: each compiled graph costs ~2 s more a layer from a cold Inductor cache, and every
# mechanism here is the same on every layer (Gemma 3's two are one sliding, one global)
LAYERS = 2


def _greedy(lm, prompts, n, **options):
    return lm.generate(prompts, max_new_tokens=n, ignore_eos=True, return_logprobs=True, **options).tokens


# compiling takes 45-80 s a family from a cold Inductor cache (as in CI): Gemma 3 on a GGUF's q8_0
# blocks (ggml's kernels, the embedding looked up in the file's table), GPT-2 (learned positions) and
# Phi-3 (a window on every layer, partial rotary) for the shared decoder's families. One compile each: of
# the steered model, whose second row runs at strength 0 (the plain model). GPT-2's and Phi-3's are
# heavy: GPT-2's float step compiles below (an unkeyed guard), windows on every layer too (Mistral) and
# in the kept steps (test_ahead.py), partial rotary in its eager tests; per-row strengths in Gemma 3's.
@pytest.mark.parametrize("family, quantize", [pytest.param("gpt2", None, marks=pytest.mark.heavy), ("gemma3", "gguf"),
                                              pytest.param("phi3", None, marks=pytest.mark.heavy)])
def test_compiled_decode_gives_eager_tokens(family, quantize, tmp_path, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    if quantize:
        pytest.importorskip("llama_cpp")
        from gguf import GGMLQuantizationType

        from .gguf_files import write_gemma3

        monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
        hf = FAMILIES[family](vocab_size=300, num_hidden_layers=LAYERS)
        write_gemma3(tmp_path / "m.gguf", hf, GGMLQuantizationType.Q8_0)
        lm = kw.load(tmp_path / "m.gguf", progress=False, quantize="gguf")
    else:
        lm = kw.from_hf(FAMILIES[family](num_hidden_layers=LAYERS))
    # rows of different lengths (left padding); 14 new tokens pass the 4- and 6-token windows
    prompts = [torch.tensor([3, 17, 42, 9, 55]), torch.tensor([7, 8])]
    vec = kw.ControlVector({1: torch.randn(lm.head.weight.shape[1], generator=torch.Generator().manual_seed(0))})
    steered = lm.steer(vec, torch.tensor([2.0, 0.0]))
    eager, short = _greedy(steered, prompts, 14), _greedy(steered, prompts, 6)
    assert eager[1] == _greedy(lm, prompts[1:], 14)[0]  # the strength-0 row is the plain model
    steered.compile(ahead=False, bucket=32)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # compiled as an engine under load runs: on fewer threads than cores
    try:
        tokens, code = run_and_get_code(lambda: _greedy(steered, prompts, 14))
    finally:
        torch.set_num_threads(before)
    assert tokens == eager  # per-row strengths are compiled-step inputs
    if (os.cpu_count() or 1) > 1:  # kernels take OpenMP's team size when they run, not the compile's
        kernels = "\n".join(code)
        assert "#pragma omp parallel" in kernels and "num_threads(" not in kernels
    graphs = _graphs()
    assert _greedy(steered, prompts, 6) == short  # a shorter call: same 32-slot cache, no new compile
    assert _graphs() == graphs
    if quantize:  # per layer q/k/v and gate/up run as two fused ggml calls; o, down and the head single,
        layers = lm.config.num_hidden_layers  # in the prompts' graph and in the decode step's
        calls = [(c.count("torch.ops.kvwire.ggml_matmuls.default("), c.count("torch.ops.kvwire.ggml_matmul.default("),
                  c.count("torch.ops.kvwire.ggml_rows.default(")) for c in code if "ggml_matmul" in c]
        assert calls == [(2 * layers, 2 * layers + 1, 1)] * 2


def test_a_call_that_differs_in_an_unkeyed_guard_recompiles_instead_of_failing():
    torch._dynamo.reset()
    lm = kw.from_hf(FAMILIES["gpt2"](num_hidden_layers=LAYERS))
    eager = _greedy(lm, [torch.tensor([3, 17, 42])], 4)
    # a model without runtime inputs: its compiled tokens equal eager's too (prefill_tokens=0: the
    # prompt runs eager, one graph to compile, the step's)
    lm.compile(ahead=False, bucket=32, prefill_tokens=0)
    before = _graphs()
    assert _greedy(lm, [torch.tensor([3, 17, 42])], 4) == eager  # the step signature is now seen: guards skipped
    assert _graphs() == before + 1
    decode, cached = lm._decoder(), lm.cached
    with torch.inference_mode():  # inference tensors, unlike generate's sampled tokens
        token, mask = torch.tensor([[5]]), torch.ones(1, 32, dtype=torch.bool)
        cache = cached.init_cache(1, 32)
        logits, _ = decode(token, torch.tensor([[0]]), torch.tensor(0), mask, cache, ())
        hidden, _ = cached(token, torch.tensor([[0]]), 0, mask, cached.init_cache(1, 32))
        torch.testing.assert_close(logits, lm.head(hidden[:, -1]), atol=1e-4, rtol=1e-4)


def test_compile_imports_torch_compile_only_when_options_need_checking(tmp_path):
    """`lm.compile()` is settings only: dynamo (~1.5 s to import) loads with the first compiled step,
    or at once when options are given, so torch.compile checks them (a GGUF file: kw.load imports
    no transformers, which would import dynamo itself)."""
    import os
    import subprocess
    import sys

    from .conftest import tiny_hf_gpt2
    from .gguf_files import write_gpt2

    write_gpt2(tmp_path / "g.gguf", tiny_hf_gpt2(vocab_size=300))
    code = ("import sys, kvwire as kw\n"
            f"lm = kw.load({str(tmp_path / 'g.gguf')!r}, progress=False).compile()\n"
            "print('torch._dynamo' in sys.modules)\n"
            "lm.compile(options={'size_asserts': True})\n"
            "print('torch._dynamo' in sys.modules)\n")
    env = {**os.environ, "KVWIRE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_bad_bucket_or_prefill_tokens():
    lm = kw.from_hf(FAMILIES["gpt2"]())
    with pytest.raises(ValueError, match="bucket must be a positive int .* got 0"):
        lm.compile(ahead=False, bucket=0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"prefill_tokens must be an int >= 0 .* got " + re.escape(repr(bad))):
            lm.compile(prefill_tokens=bad)


def test_cache_lengths_round_up_to_bucket_times_a_power_of_two():
    from kvwire.generate.compiled import CompiledDecode

    lm = kw.from_hf(FAMILIES["gpt2"]())
    decode = CompiledDecode(lm.cached, lm.head, bucket=64)  # torch.compile is lazy: nothing compiles
    assert [decode.length(n) for n in (1, 64, 65, 200, 300)] == [64, 64, 128, 256, 512]
    assert decode.length(150, limit=200) == 200  # never past the model's context


def _exporting_inside_compile():
    """Whether this torch says `is_exporting()` inside torch.compile (some versions did,
    pytorch/pytorch#176347): kvwire then keeps the functional cache update there, correct but copying."""
    return torch.compile(lambda x: x + torch.compiler.is_exporting(), backend="eager")(torch.zeros(())).item() == 1


@pytest.mark.parametrize("per_row", [False, True])
def test_compiled_decode_writes_one_slot_of_the_caches_in_place(per_row):
    """A compiled step writes each layer's new key and value into the caches it is given, as eager
    does, and copies no whole cache: Inductor's locality reordering once moved the attention's read
    of a value cache below that cache's write, and the step then copied every value cache out and
    back each token (a 900-token context decoded 1.27x slower on SmolLM2)."""

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    if _exporting_inside_compile():
        pytest.skip("this torch reports is_exporting() inside torch.compile: the update stays functional")
    lm = kw.from_hf(FAMILIES["mistral"](num_hidden_layers=LAYERS))  # a window on every layer: ring-buffer caches
    lm.compile(ahead=False, bucket=32)
    decode, cached = lm._decoder(), lm.cached
    index = torch.tensor([3, 1]) if per_row else torch.tensor(3)
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[0, :4], mask[1, :4 if not per_row else 2] = True, True
    token, positions = torch.tensor([[5], [9]]), (index if per_row else index.expand(2))[:, None]
    start = cached.init_cache(2, 32)
    for k, v in start:  # a cache holding earlier tokens
        k.normal_(generator=torch.Generator().manual_seed(1)), v.normal_(generator=torch.Generator().manual_seed(2))
    compiled_cache = tuple((k.clone(), v.clone()) for k, v in start)
    with torch.no_grad():  # as in generation (with autograd on, the update is functional)
        (logits, out), code = run_and_get_code(lambda: decode(token, positions, index, mask, compiled_cache, ()))
        hidden, eager_cache = cached(token, positions, index, mask, tuple((k.clone(), v.clone()) for k, v in start))
    torch.testing.assert_close(logits, lm.head(hidden[:, -1]), atol=1e-4, rtol=1e-4)
    for (k, v), (ek, ev), (sk, sv) in zip(compiled_cache, eager_cache, start):
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)  # the given tensors hold the new token
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=1e-5)
        for new, old in ((k, sk), (v, sv)):
            assert (new != old).any(dim=-1).any(dim=1).sum() == 2  # one slot a row changed
    assert [(k.data_ptr(), v.data_ptr()) for k, v in out] == [(k.data_ptr(), v.data_ptr()) for k, v in compiled_cache]
    # no buffer of a cache's shape is made: a functional update (or its copy back) would need one
    shape = ", ".join(map(str, compiled_cache[0][0].shape))
    assert "def call(" in "\n".join(code) and not re.search(rf"empty_strided_\w+\(\({shape}\)", "\n".join(code))


def test_short_prompts_run_through_one_compiled_graph_long_ones_eager():
    """A prompt of 2 to PREFILL_TOKENS tokens runs compiled, every length through one graph (its
    length is dynamic), written into the caches in place; a longer one runs eager. Mistral: a window
    of 5 on every layer, so chunks longer than a ring cache (4 slots) are covered too."""

    from torch._inductor.utils import run_and_get_code

    from kvwire.generate.compiled import PREFILL_TOKENS

    torch._dynamo.reset()
    if _exporting_inside_compile():
        pytest.skip("this torch reports is_exporting() inside torch.compile: the update stays functional")
    lm = kw.from_hf(FAMILIES["mistral"](num_hidden_layers=LAYERS))
    g = torch.Generator().manual_seed(0)
    short = [torch.randint(0, 96, (n,), generator=g) for n in (6, 9, PREFILL_TOKENS)]
    long = torch.randint(0, 96, (PREFILL_TOKENS + 1,), generator=g)
    eager = [_greedy(lm, [p], 4) for p in short] + [_greedy(lm, [long], 4)]
    expected_tiny = _greedy(lm, [torch.tensor([4, 50, 7])], 4)
    lm.compile(ahead=False, bucket=64)
    before = _graphs()
    tokens, code = run_and_get_code(lambda: _greedy(lm, [short[0]], 4))
    assert tokens == eager[0]
    assert _graphs() == before + 2  # the prompt's graph and the decode step's
    shape = ", ".join(map(str, lm.cached.init_cache(1, 64)[0][0].shape))  # no copy of a cache in either
    assert len(code) == 2 and not re.search(rf"empty_strided_\w+\(\({shape}\)", "\n".join(code))
    assert [_greedy(lm, [p], 4) for p in short[1:]] == eager[1:3]  # other lengths: no new graph
    assert _greedy(lm, [long], 4) == eager[3]  # eager prefill, then the compiled step
    assert _graphs() == before + 2  # (a left-padded batch: its own graphs, in the test above)

    decode, cached = lm._decoder(), lm.cached
    mask = torch.ones(1, 64, dtype=torch.bool)  # tensors made as generation makes them (the engine's mask
    with torch.inference_mode():  # outside inference mode): the graph compiled above serves the call
        ids, positions = short[1][None].clone(), torch.arange(9)[None]
        cache, eager_cache = cached.init_cache(1, 64), cached.init_cache(1, 64)
        logits, out = decode(ids, positions, torch.tensor(0), mask, cache, ())
        hidden, _ = cached(ids, positions, 0, mask, eager_cache)
        expected = lm.head(hidden[:, -1])  # inside: an inference tensor cannot enter autograd outside
    assert _graphs() == before + 2
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    for (k, v), (ek, ev), (ok, ov) in zip(cache, eager_cache, out):
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)  # written into the given caches
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=1e-5)
        assert ok.data_ptr() == k.data_ptr() and ov.data_ptr() == v.data_ptr()

    # shorter than the ring caches: a length the prompt graph does not hold, compiled anew
    assert _greedy(lm, [torch.tensor([4, 50, 7])], 4) == expected_tiny
    assert _graphs() == before + 3


def test_a_batch_of_short_prompts_on_q4_1_compiles_whole_graphs():
    """Two prompts of 20 and 18 tokens are 40 rows, past where eager Q4_1 matmuls dequantise to a
    float GEMM (a ctypes call, which would break a compiled graph into dozens): compiled graphs keep
    ggml's op, so the batch costs two graphs (its prompts' and its steps') and gives eager's tokens."""
    pytest.importorskip("llama_cpp")
    torch._dynamo.reset()
    lm = kw.from_hf(FAMILIES["gemma3"](num_hidden_layers=LAYERS))
    kw.quantize(lm, "q4_1")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (20, 18)]
    eager = _greedy(lm, prompts, 3)
    lm.compile(ahead=False, bucket=32)
    before, breaks = _graphs(), sum(torch._dynamo.utils.counters["graph_break"].values())
    assert _greedy(lm, prompts, 3) == eager
    assert _graphs() == before + 2
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks


def test_compiled_decode_with_a_mode_keeps_the_functional_update():
    """`lm.compile(mode=...)` runs Inductor without kvwire's passes (locality reordering stays on),
    so the step keeps returning updated caches (e.g. what CUDA graphs want): still eager's values."""
    torch._dynamo.reset()
    lm = kw.from_hf(FAMILIES["llama"](num_hidden_layers=LAYERS))
    eager = _greedy(lm, [torch.tensor([3, 17, 42, 9])], 5)
    lm.compile(ahead=False, bucket=32, prefill_tokens=0, mode="default")
    decode, cached = lm._decoder(), lm.cached
    assert _greedy(lm, [torch.tensor([3, 17, 42, 9])], 5) == eager
    cache = cached.init_cache(1, 32)
    with torch.no_grad():
        _, out = decode(torch.tensor([[5]]), torch.tensor([[0]]), torch.tensor(0), torch.ones(1, 32, dtype=torch.bool),
                        cache, ())
    assert out[0][0].data_ptr() != cache[0][0].data_ptr() and not cache[0][0].any()  # new tensors; input untouched


def test_reduce_overhead_keeps_the_in_place_step_with_static_caches():
    """`mode="reduce-overhead"` (CUDA graphs) runs kvwire's in-place step with Inductor's CUDA graphs
    on (on the CPU Inductor leaves them out): the caches are written where they are, marked as static
    addresses, and the logits handed back are a copy, not the graph's output buffer."""
    from kvwire.generate.compiled import _with_passes

    options = _with_passes({"mode": "reduce-overhead", "fullgraph": True})
    assert "mode" not in options and options["fullgraph"] is True
    assert options["options"]["triton.cudagraphs"] is True and options["options"]["reorder_for_locality"] is False
    torch._dynamo.reset()
    lm = kw.from_hf(FAMILIES["llama"](num_hidden_layers=LAYERS))
    eager = _greedy(lm, [torch.tensor([3, 17, 42, 9])], 5)
    lm.compile(ahead=False, bucket=32, prefill_tokens=0, mode="reduce-overhead")
    decode, cached = lm._decoder(), lm.cached
    assert decode.cudagraphs and not decode.use_direct
    assert _greedy(lm, [torch.tensor([3, 17, 42, 9])], 5) == eager
    cache = cached.init_cache(1, 32)
    with torch.no_grad():
        _, out = decode(torch.tensor([[5]]), torch.tensor([[0]]), torch.tensor(0), torch.ones(1, 32, dtype=torch.bool),
                        cache, ())
    assert out[0][0].data_ptr() == cache[0][0].data_ptr() and cache[0][0][:, :, 0].any()  # written in place
    assert all(t._dynamo_static_input_type == "unguarded" for pair in cache for t in pair)


def test_decode_steps_call_inductor_directly_and_refuse_what_they_cannot_stand_in_for():
    """After the call that compiles a decode step, later steps of its signature call Inductor's
    function directly (past dynamo) and give eager's tokens; a recorded graph that is not the whole
    call (two graphs, caches not returned as given, a differing result) is refused."""
    from kvwire.generate.direct import DirectCalls, flat_args

    torch._dynamo.reset()
    lm = kw.from_hf(FAMILIES["llama"](num_hidden_layers=LAYERS))
    eager = _greedy(lm, [torch.tensor([3, 17, 42, 9])], 6)
    lm.compile(ahead=False, bucket=32, prefill_tokens=0)
    assert _greedy(lm, [torch.tensor([3, 17, 42, 9])], 6) == eager
    decode = lm._decoder()
    assert len(decode.direct) == 1 and not decode.seen  # the one decode signature, never through dynamo again
    fresh = kw.from_hf(FAMILIES["llama"](num_hidden_layers=LAYERS))
    assert _greedy(lm, [torch.tensor([8, 1])], 6) == _greedy(fresh, [torch.tensor([8, 1])], 6)

    calls, x, other = DirectCalls({}), torch.ones(2), [torch.zeros(1) for _ in range(3)]
    cache = [(torch.zeros(1), torch.zeros(1))]
    before = [torch.zeros(1), torch.zeros(1)]  # the caches as the compiling call found them
    args = (x, *other, cache)
    calls.compiled = [([x], lambda *a: [a[0] * 2]), ([x], lambda *a: [a[0]])]
    assert calls.entry(flat_args(args), cache, (x * 2, cache), before) is None  # two graphs: dynamo's glue between them
    calls.compiled = [([x], lambda *a: [a[0] * 2])]
    assert calls.entry(flat_args(args), cache, (x * 2, [(torch.zeros(1), torch.zeros(1))]), before) is None  # new caches returned
    calls.compiled = [([x], lambda *a: [a[0] * 3])]
    assert calls.entry(flat_args(args), cache, (x * 2, cache), before) is None  # not dynamo's logits
    calls.compiled = [([x, 2], lambda *a: [a[0] * 2])]
    assert calls.entry(flat_args(args), cache, (x * 2, cache), before) is None  # a size input (a dynamic prompt length)
    calls.compiled = [([x], lambda *a: [a[0] * 2])]
    assert calls.entry(flat_args((x, x, *other[1:], cache)), cache, (x * 2, cache), before) is None  # one tensor in two arguments
    calls.compiled = [([x, torch.full((2,), 3.0)], lambda *a: [a[0] * a[1]])]
    step = calls.entry(flat_args(args), cache, (x * 3, cache), before)
    y = torch.full((2,), 5.0)
    assert step is not None and torch.equal(step(flat_args((y, *other, cache)), cache)[0], y * 3)  # args by position, weights held
    # the check re-runs the step on the copies, not on the caches the compiling call already wrote
    calls.compiled = [([x, cache[0][0]], lambda *a: [a[0] * 2 + a[1].add_(1) * 0])]
    assert calls.entry(flat_args(args), cache, (x * 2, cache), before) is not None
    assert cache[0][0].item() == 0 and before[0].item() == 1


def test_a_ring_caches_first_compiled_step_late_in_the_timeline_keeps_eagers_tokens():
    """Mistral's tiny config: a window of 5 in 4 ring slots, so the first compiled step (position 30,
    slot 2) reads the slot it then overwrites. Checking that the direct call stands in for it once
    ran the step a second time on the written caches: every layer after the first stored wrong keys
    and values there, and the tokens parted from eager's two steps later."""
    torch._dynamo.reset()
    prompt = [torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(0))]
    lm = kw.from_hf(FAMILIES["mistral"](seed=0, num_hidden_layers=LAYERS))
    eager = lm.generate(prompt, max_new_tokens=5, ignore_eos=True, return_logprobs=True)
    lm.compile(ahead=False, bucket=32, prefill_tokens=0)
    compiled = lm.generate(prompt, max_new_tokens=5, ignore_eos=True, return_logprobs=True)
    assert compiled.tokens == eager.tokens
    assert len(lm._decoder().direct) == 1  # steps after the first called Inductor directly
    torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs), atol=1e-4, rtol=1e-4)
