"""Wrong values in well-formed files, for test_corrupt_files: GGUF metadata of the wrong type,
range or kind, missing keys, unsupported settings; Hugging Face folders with broken safetensors,
index, config.json and tokenizer files. See corrupt_cases.py for what a case is."""
import copy
import json
import struct

from .corrupt_cases import BOOL, F32, I32, U32, U64, VALUE_KEYS, edited
from .gguf_files import ARRAY, STRING, GGUFParts


def gguf_metadata_cases(cases, arch, path):
    """Wrong types, ranges, missing keys and unsupported settings, each in a well-formed file."""
    metadata_cases(cases, f"gguf-{arch}", arch, GGUFParts(path))


def metadata_cases(cases, prefix, arch, p):
    """Wrong types, ranges, missing keys and unsupported settings, each in a well-formed file."""
    def add(expect, what, match=None, **edits):
        cases.add(prefix, edited(p, **edits), expect, what, match=match)

    for a in (1, 64, 4096):  # any power of two is a valid layout
        add("same", f"alignment {a}", sets=[("general.alignment", U32, a)], alignment=a)
    for value, vtype in [(0, U32), (3, U32), (48, U32), (2 ** 31, U32), ("32", STRING), (32.0, F32), (True, BOOL)]:
        add("error", f"general.alignment = {value!r}", "general.alignment", sets=[("general.alignment", vtype, value)])
    ints = [k for k, t, _ in p.kvs if k.startswith(arch + ".") and t in (U32, I32, U64)]
    floats = [k for k, t, _ in p.kvs if k.startswith(arch + ".") and t == F32]
    for key in ints + floats:
        add("free" if key.endswith(_OPTIONAL) else "error", f"no {key}", drops=[key])
        bad = [("4", STRING), (True, BOOL), ((U32, [4]), ARRAY), (-1, I32), (0, U32)] + \
            ([(4.0, F32), (2 ** 40, U64)] if key in ints else [(float("nan"), F32), (float("inf"), F32), (-1.0, F32)])
        for value, vtype in bad:
            if key.endswith("epsilon") and value == 0:
                continue  # an epsilon of 0 is a valid (if unusual) model
            valid = value == 2 ** 40 and key.endswith(VALUE_KEYS)  # a huge window or context is a model
            cases.add(prefix, edited(p, sets=[(key, vtype, value)]), "free" if valid else "error",
                      f"{key} = {value!r}", match=key if vtype != U64 else None, may_differ=valid)
    heads = p.get(f"{arch}.attention.head_count")
    add("error", "head_count_kv not dividing head_count", "multiple of|one key/value head",
        sets=[(f"{arch}.attention.head_count_kv", U32, heads - 1)])
    add("error", "an unknown architecture key", "unknown metadata",
        sets=[(f"{arch}.attention.head_countx", U32, heads)])
    add("error", "no context_length", f"has no '{arch}.context_length'", drops=[f"{arch}.context_length"])
    add("error", "vocab_size disagreeing with the tokens", "vocab_size", sets=[(f"{arch}.vocab_size", U32, 7)])
    if arch == "gemma3":
        for kind in ("yarn", "longrope", "dynamic"):
            add("error", f"rope scaling {kind}", f"rope.scaling.type = '{kind}' is not supported",
                sets=[(f"{arch}.rope.scaling.type", STRING, kind), (f"{arch}.rope.scaling.factor", F32, 4.0)])
        add("same", "rope scaling none", sets=[(f"{arch}.rope.scaling.type", STRING, "none")])
        add("same", "rope scaling linear by 1", sets=[(f"{arch}.rope.scaling.type", STRING, "linear"),
                                                       (f"{arch}.rope.scaling.factor", F32, 1.0)])
        add("error", "a negative rope factor", "rope.scaling.factor", sets=[
            (f"{arch}.rope.scaling.type", STRING, "linear"), (f"{arch}.rope.scaling.factor", F32, -2.0)])
        add("error", "value_length != key_length", "value_length", sets=[(f"{arch}.attention.value_length", U32, 16)])
    n = _array_length(p, "tokenizer.ggml.tokens")
    tok = "tokenizer.ggml."
    for what, edits in [
        ("tokens as integers", dict(sets=[(tok + "tokens", ARRAY, (I32, list(range(n))))])),
        ("no tokens", dict(drops=[tok + "tokens"])),
        ("empty tokens", dict(sets=[(tok + "tokens", ARRAY, (STRING, []))])),
        ("tokens as a string", dict(sets=[(tok + "tokens", STRING, "abc")])),
        ("nested token arrays", dict(sets=[(tok + "tokens", ARRAY, (ARRAY, []))])),
        ("token types as strings", dict(sets=[(tok + "token_type", ARRAY, (STRING, ["1"] * n))])),
        ("one token type too few", dict(sets=[(tok + "token_type", ARRAY, (I32, [1] * (n - 1)))])),
        ("bos id out of range", dict(sets=[(tok + "bos_token_id", U32, 10 ** 6)])),
        ("bos id negative", dict(sets=[(tok + "bos_token_id", I32, -1)])),
        ("bos id a string", dict(sets=[(tok + "bos_token_id", STRING, "2")])),
        ("eos id out of range", dict(sets=[(tok + "eos_token_id", U32, n)])),
        ("add_bos_token a string", dict(sets=[(tok + "add_bos_token", STRING, "yes")])),
        ("add_bos_token without a bos id",
         dict(sets=[(tok + "add_bos_token", BOOL, True)], drops=[tok + "bos_token_id"])),
        ("an unknown tokenizer model", dict(sets=[(tok + "model", STRING, "bert")])),
        ("a numeric tokenizer model", dict(sets=[(tok + "model", U32, 1)])),
        ("no architecture", dict(drops=["general.architecture"])),
        ("a numeric architecture", dict(sets=[("general.architecture", U32, 1)])),
        ("a duplicate tensor name", dict(tensors=lambda q: q.tensors.append(copy.copy(q.tensors[-1])))),
    ]:
        add("error", what, **edits)
    if arch == "gpt2":
        add("error", "a merge without a space", "merges", sets=[(tok + "merges", ARRAY, (STRING, ["ab"]))])
        add("error", "merges of unknown tokens", "out of vocabulary",
            sets=[(tok + "merges", ARRAY, (STRING, ["zz qq"]))])
        add("error", "n_head not dividing n_embd", "multiple of", sets=[(f"{arch}.attention.head_count", U32, 3)])


# keys with defaults: dropped, the default is the test files' value, or a size check catches it
_OPTIONAL = ("attention.value_length", "rope.freq_base", "attention.layer_norm_epsilon",
             "attention.head_count_kv", "attention.key_length")


def _array_length(p, key):
    raw = next(r for k, t, r in p.kvs if k == key)
    return struct.unpack_from("<Q", raw, 4)[0]  # after the item type


def _put(name, content):
    """An edit that overwrites one file of a folder."""
    def edit(folder):
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content)
    return edit


def hf_cases(cases, family, folder):
    """Broken safetensors, index, config and tokenizer files of the valid Hugging Face folder."""
    prefix = f"hf-{family}"
    cases.control(prefix, folder)
    tensor = _safetensors_cases(cases, prefix, folder, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    common = [("model_type", 7), ("model_type", None), ("tie_word_embeddings", "yes"), ("tie_word_embeddings", 1),
              ("eos_token_id", "1"), ("bos_token_id", -3)]
    for key, value in _CONFIG_EDITS[family] + common:  # None: the key dropped
        edited = dict(config, **{key: value}) if value is not None else {k: v for k, v in config.items() if k != key}
        cases.add_folder(prefix, folder, _put("config.json", json.dumps(edited)), "error", f"config {key} = {value!r}")
    index = json.dumps({"weight_map": {tensor: "missing.safetensors"}})
    for name, what, content in [
        ("config.json", "config.json not JSON", "{"), ("config.json", "config.json a list", "[1, 2]"),
        ("config.json", "config.json not UTF-8", b"\xff\xfe{}"),
        ("model.safetensors.index.json", "an index naming a missing shard", index),
        ("model.safetensors.index.json", "an index that is not JSON", "{"),
        ("model.safetensors.index.json", "an index without a weight_map", "{}"),
        ("model.safetensors.index.json", "an index naming a file elsewhere", index.replace("missing", "../elsewhere")),
    ]:
        cases.add_folder(prefix, folder, _put(name, content), "error", what)
    if (folder / "tokenizer.json").is_file():
        text = (folder / "tokenizer.json").read_text()
        for name, what, content in [
            ("tokenizer.json", "tokenizer.json truncated", text[:len(text) // 2]),
            ("tokenizer_config.json", "tokenizer_config.json not JSON", "{"),
            ("tokenizer_config.json", "add_bos_token a string", '{"add_bos_token": "yes"}'),
        ]:
            cases.add_folder(prefix, folder, _put(name, content), "error", what)


def _safetensors_cases(cases, prefix, folder, weights):
    """Truncations, header lengths and headers that lie; returns the name of the tensor lied about."""
    data = weights.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    for cut in sorted({0, 4, 8, 9, 8 + n // 2, 8 + n, 8 + n + 100, len(data) // 2, len(data) - 1}):
        cases.add_folder(prefix, folder, _put(weights.name, data[:cut]), "error", f"safetensors truncated at {cut}")
    for new in (0, 7, len(data), 2 ** 63):
        cases.add_folder(prefix, folder, _put(weights.name, struct.pack("<Q", new) + data[8:]), "error",
                         f"safetensors header length {new}")
    cases.add_folder(prefix, folder, _put(weights.name, data[:8] + b"{not json" + data[17:]), "error",
                     "a header that is not JSON")
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    info = header[name]
    rows, cols = info["shape"]
    for what, change in [
        ("a tensor claiming more rows", {"shape": [rows * 2, cols]}),
        ("a tensor past the end", {"data_offsets": [info["data_offsets"][0], len(data)]}),
        ("a tensor as I32", {"dtype": "I32"}),  # as many bytes: it reads, but is not a weight
        ("a tensor as F16", {"dtype": "F16"}),
        ("a tensor transposed", {"shape": [cols, rows]}),
    ]:
        text = json.dumps(dict(header, **{name: dict(info, **change)})).encode()
        text += b" " * (-len(text) % 8)
        lied = struct.pack("<Q", len(text)) + text + data[8 + n:]
        cases.add_folder(prefix, folder, _put(weights.name, lied), "free" if [cols, rows] == [rows, cols] and
                         "transposed" in what else "error", what)
    return name


_CONFIG_EDITS = {
    "gpt2": [("n_embd", "32"), ("n_embd", 32.0), ("n_head", 5), ("n_head", 0), ("n_head", True), ("n_layer", -1),
             ("n_positions", 0), ("layer_norm_epsilon", float("nan")), ("layer_norm_epsilon", "1e-5"),
             ("vocab_size", [96]), ("activation_function", 3), ("activation_function", "swish?"), ("n_inner", "x"),
             ("scale_attn_weights", "no")],
    "gemma3": [("num_key_value_heads", 3), ("sliding_window_pattern", 0), ("head_dim", 0), ("hidden_size", "32"),
               ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("rope_scaling", "linear"),
               ("layer_types", 5), ("layer_types", ["sliding_attention"] * 3), ("rope_parameters", "x"),
               ("rms_norm_eps", float("inf")), ("max_position_embeddings", -1), ("query_pre_attn_scalar", "8"),
               ("sliding_window", 2.5), ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0,
                                                                             "rope_theta": 1e6}})],
}
