"""`kvwire info`: the paths it reports are the ones kvwire takes on this CPU (whichever branch the
machine runs), settings kvwire would refuse show as invalid with the reason and exit 1."""
import importlib.util
import json

import pytest
import torch

from kvwire import cli
from kvwire.info import cpu_name, info
from kvwire.kernels import cpu


@pytest.fixture
def fresh_choices(monkeypatch):
    """No overriding variables from the caller's shell; the cached choices cleared before and after
    (they read the environment once)."""
    for name in ("KVWIRE_BF16_GEMM", "KVWIRE_F32_GEMV", "KVWIRE_F32_ROW", "KVWIRE_FUSED", "KVWIRE_GGML_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    clear = (cpu.bf16_gemm.cache_clear, cpu.f32_gemv.cache_clear, cpu.f32_row.cache_clear, cpu.fused.cache_clear)
    for c in clear:
        c()
    yield
    for c in clear:
        c()


def test_the_report_names_the_paths_kvwire_takes(fresh_choices, capsys):
    report = info()
    assert report["cpu"]["features"] == cpu.features()
    assert report["paths"]["bf16_gemm"] == cpu.bf16_gemm()
    assert report["paths"]["f32_gemv"] == cpu.f32_gemv()
    assert report["paths"]["f32_row"].split(" ")[0] == cpu.f32_row()
    assert report["paths"]["fused"].split(" ")[0] == cpu.fused()
    if importlib.util.find_spec("llama_cpp") is None:
        assert report["paths"]["ggml_kernel"] == "not installed"
    else:
        from kvwire.kernels.cpu import ggml_kernel
        from kvwire.kernels.ggml.lib import loaded_or_built
        if loaded_or_built():  # asking ggml_kernel() otherwise would build the bridge (~15 s)
            assert report["paths"]["ggml_kernel"].split(";")[0] == ggml_kernel()
        else:
            assert report["paths"]["ggml_kernel"].split(";")[0].endswith("(expected: kvwire's bridge to ggml is "
                                                                         "built on first use, ~15 s)")
        f = cpu.features()
        avx2_alone = f["avx2"] and not (f["avx512"] and f["avx512_vnni"])
        shown = report["paths"]["ggml_kernel"]
        assert shown.endswith("x16 runs Q4_1, Q8_0, Q4_K and Q6_K alone on AVX2 without AVX-512 VNNI") == (
            avx2_alone and shown.startswith("x16"))
        assert shown.endswith("x16 has an AVX2 kernel alone for it, taken without VNNI") == (
            not avx2_alone and shown.startswith("x16"))
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"bfloat16 GEMM: {cpu.bf16_gemm()} " in text
    assert f"float32 GEMV: {cpu.f32_gemv()} " in text
    assert f"float32 one-row products: {cpu.f32_row()} " in text
    assert f"gated MLP and RMSNorm in one pass: {cpu.fused()} " in text
    assert f"capability {report['cpu']['capability']}" in text
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["paths"] == report["paths"]
    assert torch.is_grad_enabled()  # main(argv) runs without grad and gives the caller's mode back


@pytest.mark.parametrize("variable, value, expected", [
    ("KVWIRE_BF16_GEMM", "bogus", "expected one of packed, native, upcast"),
    ("KVWIRE_F32_GEMV", "bogus", "expected one of linear, transposed"),
    ("KVWIRE_F32_ROW", "bogus", "expected one of kvwire, mkl"),
    ("KVWIRE_FUSED", "bogus", "expected one of kvwire, aten"),
    ("KVWIRE_GGML_KERNEL", "fastest", "expected one of"),
])
def test_an_invalid_setting_is_shown_with_its_reason_and_exits_1(variable, value, expected, fresh_choices,
                                                                  monkeypatch, capsys):
    if variable == "KVWIRE_GGML_KERNEL" and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("ggml (llama-cpp-python) is not installed: no kernel is chosen")
    monkeypatch.setenv(variable, value)
    assert cli.main(["info"]) == 1
    text = capsys.readouterr().out
    assert f"invalid: {variable}={value!r}; {expected}" in text
    assert f"set: {variable}={value!r}" in text


def test_a_bf16_path_the_cpu_cannot_run_is_invalid_naming_the_missing_units(fresh_choices, monkeypatch, capsys):
    if cpu.native_bf16():
        pytest.skip("this CPU has bf16 units: every bf16 path runs here (the refusal is tested where it has not)")
    monkeypatch.setenv("KVWIRE_BF16_GEMM", "packed")
    assert cli.main(["info"]) == 1
    assert "neither AVX512_BF16 nor AMX" in capsys.readouterr().out


def test_cpu_name_reads_cpuinfo_and_falls_back(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t: avx2\n")
    assert cpu_name(str(cpuinfo)) == "Example CPU 9000"
    assert cpu_name(str(tmp_path / "absent"))  # platform's name or "unknown CPU", never empty


@pytest.fixture
def with_ggml():
    pytest.importorskip("llama_cpp")
    from kvwire.kernels.ggml import lib
    return lib


def test_before_the_bridge_is_built_the_kernel_is_foretold_not_built(with_ggml, monkeypatch):
    monkeypatch.setattr(with_ggml, "loaded_or_built", lambda: False)
    monkeypatch.setattr(with_ggml, "library", lambda: pytest.fail("info must not build or load the bridge"))
    f = cpu.features()
    expected = "x16" if f["avx512"] and f["avx512_vnni"] or f["avx2"] else "ggml"
    assert info()["paths"]["ggml_kernel"].startswith(f"{expected} (expected:")
    monkeypatch.setenv("KVWIRE_GGML_KERNEL", "ggml")
    assert info()["paths"]["ggml_kernel"].startswith("ggml (expected:")


def test_a_bridge_that_cannot_be_built_is_unavailable_not_an_error(with_ggml, monkeypatch, capsys):
    def broken():
        raise with_ggml.GGMLUnavailable("no C compiler: set CC or install gcc")
    monkeypatch.setattr(with_ggml, "loaded_or_built", broken)
    assert cli.main(["info"]) == 0  # nothing the user set is wrong
    assert "unavailable: GGMLUnavailable: no C compiler" in capsys.readouterr().out


def test_an_unreadable_cache_is_reported(monkeypatch, capsys):
    class Unreadable(type(__import__("pathlib").Path())):
        def is_dir(self):
            return True

        def iterdir(self):
            raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr("kvwire.info.cache_root", lambda: Unreadable("/cache"))
    assert cli.main(["info"]) == 0
    assert "cache: /cache (unreadable: [Errno 13] Permission denied" in capsys.readouterr().out


def test_compiled_steps_made_for_another_torch_or_cpu_are_counted(tmp_path, monkeypatch, capsys):
    """Kept steps are keyed on torch and the CPU: those made elsewhere are never loaded here, and
    `kvwire info` says how many there are; the folders beside converted models are not models."""
    from kvwire.generate.ahead import machine

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    for key, name, made_for in [("a", "p1", machine()), ("a", "p2", machine()), ("b", "p3", ["2.0", "x", "y", "z"])]:
        (tmp_path / "steps" / key).mkdir(parents=True, exist_ok=True)
        (tmp_path / "steps" / key / f"{name}.pt2").write_bytes(b"\0" * 1000)
        (tmp_path / "steps" / key / f"{name}.json").write_text(json.dumps({"machine": made_for}))
    (tmp_path / "steps" / "b" / "p4.json").write_text("{half")  # being written: not counted
    (tmp_path / "verified").mkdir()
    assert info()["cache"]["steps"] == {"packages": 3, "foreign": 1, "bytes": 3000 + sum(
        (tmp_path / "steps" / k / f"p{i}.json").stat().st_size for k, i in [("a", 1), ("a", 2), ("b", 3)])}
    assert info()["cache"]["entries"] == 0
    assert cli.main(["info"]) == 0
    assert "compiled steps: 3 packages (1 made for another torch or CPU: never loaded here" in capsys.readouterr().out


def test_cache_prune_removes_foreign_steps_and_superseded_models_only(tmp_path, monkeypatch, capsys):
    """`kvwire cache prune`: compiled steps made for another torch or CPU and converted models whose
    file is gone or changed go; this machine's steps, a record still being written, current models
    and folders that are not entries stay. `--dry-run` lists the same and removes nothing."""
    from kvwire.generate.ahead import machine
    from kvwire.io.weights_cache import SOURCE, _stamp

    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path))
    steps = tmp_path / "steps"
    for key, name, made_for in [("a", "p1", machine()), ("b", "p2", ["2.0", "x", "y", "z"]),
                                ("c", "p3", ["2.0", "x", "y", "z"])]:
        (steps / key).mkdir(parents=True, exist_ok=True)
        (steps / key / f"{name}.pt2").write_bytes(b"\0" * 1000)
        (steps / key / f"{name}.json").write_text(json.dumps({"machine": made_for}))
    (steps / "b" / "p4.json").write_text("{half")  # being written
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 10)
    for entry, source in [("current", _stamp(model)), ("gone", {**_stamp(model), "path": str(tmp_path / "x.gguf")}),
                          ("changed", {**_stamp(model), "size": 11})]:
        (tmp_path / entry).mkdir()
        (tmp_path / entry / SOURCE).write_text(json.dumps(source))
        (tmp_path / entry / "weights.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "ggml").mkdir()  # built kernels: no record, never an entry
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    assert cli.main(["cache", "prune", "--dry-run", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(listed["models"]) == [str(tmp_path / "changed"), str(tmp_path / "gone")]
    assert listed["steps"] == [str(steps / "b" / "p2.pt2"), str(steps / "c" / "p3.pt2")]
    foreign = sum((steps / k / f"{n}.json").stat().st_size + 1000 for k, n in [("b", "p2"), ("c", "p3")])
    models = sum(len(source) + 100 for source in [(tmp_path / e / SOURCE).read_bytes() for e in ("changed", "gone")])
    assert listed["bytes"] == foreign + models and listed["dry_run"] is True
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

    assert cli.main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 superseded converted models and 2 compiled steps made for another torch or CPU" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "ggml", "m.gguf", "steps"]
    assert sorted(str(p.relative_to(steps)) for p in steps.rglob("*")) == ["a", "a/p1.json", "a/p1.pt2", "b",
                                                                           "b/p4.json"]
    assert info()["cache"]["steps"]["foreign"] == 0 and info()["cache"]["superseded"] == 0
    assert cli.main(["cache", "prune"]) == 0  # nothing left to remove
    assert "removed 0 superseded converted models and 0 compiled steps" in capsys.readouterr().out
