"""`quantize="auto"` (and `kvwire serve`'s default): a GGUF file of quantised blocks runs them on
ggml's kernels where ggml is installed and the weights are on the CPU; otherwise float weights,
with a reason that says what would change it."""
import importlib
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType

import kvwire as kw
from kvwire.kernels.ggml.lib import GGMLUnavailable
from kvwire.load import auto_quantize

from .conftest import FAMILIES
from .gguf_files import write_gemma3

load_module = importlib.import_module("kvwire.load")  # the module: `kvwire.load` is also the function


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWIRE_CACHE", str(tmp_path / "cache"))
    hf = FAMILIES["gemma3"](vocab_size=300)
    write_gemma3(tmp_path / "q8.gguf", hf, GGMLQuantizationType.Q8_0)
    write_gemma3(tmp_path / "f32.gguf", hf)
    return tmp_path


def test_a_quantised_gguf_runs_its_blocks_where_ggml_is_installed(files):
    pytest.importorskip("llama_cpp")
    assert auto_quantize(files / "q8.gguf") == ("gguf", "the file's own Q8_0 blocks on ggml's kernels")
    lm = kw.load(files / "q8.gguf", progress=False, quantize="auto")
    wanted = kw.load(files / "q8.gguf", progress=False, quantize="gguf")
    ids = torch.tensor([[3, 17, 42, 9]])
    torch.testing.assert_close(lm(ids), wanted(ids))
    assert lm.generate(ids[0], max_new_tokens=4).tolist() == wanted.generate(ids[0], max_new_tokens=4).tolist()


def test_float_files_folders_and_other_devices_keep_float_weights(files):
    assert auto_quantize(files / "f32.gguf") == (None, "float weights (the GGUF file holds no quantised blocks)")
    assert auto_quantize(files) == (None, "float weights (not a GGUF file)")
    choice, why = auto_quantize(files / "q8.gguf", device="cuda")
    assert choice is None and "run on ggml's CPU kernels, not on cuda" in why
    lm = kw.load(files / "f32.gguf", progress=False, quantize="auto")
    assert not any("GGML" in type(m).__name__ for m in lm.modules())


def test_without_ggml_the_reason_names_the_extra(files, monkeypatch):
    def missing():
        raise GGMLUnavailable("no llama-cpp-python")

    monkeypatch.setattr(load_module, "ggml_dirs", missing)
    choice, why = auto_quantize(files / "q8.gguf")
    assert choice is None and 'pip install "kvwire[ggml]"' in why and "Q8_0" in why


def test_the_server_command_says_which_weights_it_chose(files, monkeypatch, capsys):
    """`kvwire serve` resolves --quantize auto before loading and says so on stderr."""
    from kvwire.cli import main
    from kvwire.cli import serve as serve_cli

    seen = {}

    def fake_load(args, quantize):
        seen["quantize"] = quantize
        raise SystemExit(0)  # stop before serving

    monkeypatch.setattr(serve_cli, "load_model", fake_load)
    monkeypatch.setattr(load_module, "ggml_dirs", lambda: (None, None))
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(files / "q8.gguf")])
    assert seen["quantize"] == "gguf"
    assert "weights: the file's own Q8_0 blocks on ggml's kernels (--quantize gguf)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(files / "q8.gguf"), "--quantize", "none"])
    assert seen["quantize"] == "none"


def test_the_server_compiles_its_steps_by_default_for_gguf_blocks_only(files, monkeypatch, capsys):
    """`kvwire serve`: compiled steps are the default where the weights are a GGUF file's blocks on
    ggml's kernels (a batch-1 step there is mostly small ops), eager for float weights; --compile /
    --no-compile decide otherwise, and start-up says which and why."""
    import kvwire.serve as serve_package
    from kvwire.cli import main
    from kvwire.cli import serve as serve_cli

    compiled = []

    def fake_load(args, quantize):
        compiled.append(args.compile)
        return SimpleNamespace(device=torch.device("cpu"))

    monkeypatch.setattr(serve_cli, "load_model", fake_load)
    monkeypatch.setattr(serve_cli, "load_served", fake_load)
    monkeypatch.setattr(load_module, "ggml_dirs", lambda: (None, None))
    monkeypatch.setattr(serve_package, "create_app", lambda lm, name, **options: object())
    monkeypatch.setattr(serve_package, "serve", lambda app, **kw: None)
    main(["serve", "--model", str(files / "f32.gguf")])
    assert "decode: eager steps (default for float weights); --compile decodes faster" in capsys.readouterr().err
    main(["serve", "--model", str(files / "q8.gguf")])
    assert "decode: compiled steps (default for GGUF blocks; --no-compile for eager steps)" in capsys.readouterr().err
    main(["serve", "--model", str(files / "q8.gguf"), "--no-compile"])
    assert "decode: eager steps (--no-compile)" in capsys.readouterr().err
    main(["serve", "--model", str(files / "q8.gguf"), "--quantize", "none"])
    main(["serve", "--model", str(files / "f32.gguf"), "--compile"])
    assert compiled == [False, True, False, False, True]


def test_the_server_leaves_a_core_to_its_event_loop_for_eager_steps_only(files, monkeypatch):
    """`kvwire serve` decodes eager steps on one thread fewer than torch's pool (at least 1): their
    op-by-op Python fights the event loop for a core. Compiled steps (GGUF blocks' default) keep the
    whole pool. --decode-threads decides otherwise."""
    import kvwire.serve as serve_package
    from kvwire.cli import main
    from kvwire.cli import serve as serve_cli

    seen = []
    monkeypatch.setattr(serve_cli, "load_served", lambda args, quantize: object())
    monkeypatch.setattr(load_module, "ggml_dirs", lambda: (None, None))
    monkeypatch.setattr(serve_package, "create_app", lambda lm, name, **options: seen.append(options) or
                        (_ for _ in ()).throw(SystemExit(0)))
    before = torch.get_num_threads()
    f32, q8 = str(files / "f32.gguf"), str(files / "q8.gguf")
    try:
        for threads, flags, want in ((2, [f32], 1), (1, [f32], 1), (4, [f32], 3), (4, [f32, "--decode-threads", "4"], 4),
                                     (2, [q8], 2), (4, [q8], 4), (2, [q8, "--no-compile"], 1),
                                     (4, [q8, "--decode-threads", "1"], 1), (2, [f32, "--compile"], 2)):
            torch.set_num_threads(threads)
            with pytest.raises(SystemExit):
                main(["serve", "--model", *flags])
            assert seen[-1]["decode_threads"] == want, (threads, flags)
    finally:
        torch.set_num_threads(before)
