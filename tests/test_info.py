"""`kvwire info`: the paths it reports are the ones kvwire takes on this CPU (whichever branch the
machine runs), settings kvwire would refuse show as invalid with the reason and exit 1."""
import importlib.util
import json

import pytest

from kvwire import cli
from kvwire.info import cpu_name, info
from kvwire.layers import cpu


@pytest.fixture
def fresh_choices():
    """Clear the cached choices before and after (they read the environment once)."""
    cpu.bf16_gemm.cache_clear()
    yield
    cpu.bf16_gemm.cache_clear()


def test_the_report_names_the_paths_kvwire_takes(fresh_choices, capsys):
    report = info()
    assert report["cpu"]["features"] == cpu.features()
    assert report["paths"]["bf16_gemm"] == cpu.bf16_gemm()
    if importlib.util.find_spec("llama_cpp") is None:
        assert report["paths"]["ggml_kernel"] == "not installed"
    else:
        from kvwire.quant.ggml.linear import ggml_kernel
        assert report["paths"]["ggml_kernel"] == ggml_kernel()
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"bfloat16 GEMM: {cpu.bf16_gemm()} " in text
    assert f"capability {report['cpu']['capability']}" in text
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["paths"] == report["paths"]


@pytest.mark.parametrize("variable, value, expected", [
    ("KVWIRE_BF16_GEMM", "bogus", "expected one of packed, native, upcast"),
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
