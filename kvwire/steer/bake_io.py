"""The checkpoints `kvwire.steer.bake` edits: where each family writes to the residual stream in
Hugging Face state dicts and GGUF files, which families are refused and why, and reading and
writing them. Nothing here knows what the edit is: callers pass the tensors that change.

A GGUF is rewritten with the `gguf` package as its `gguf_new_metadata.py` script copies one: every
metadata key with its own type, every tensor in order, quantised ones as their raw blocks; only the
tensors given new values are written again, as F32 or F16.
"""
import json
import re
import shutil
from pathlib import Path

import numpy as np

from ..io.safetensors_dir import read_config, read_state_dict
from ..models import by_hf_model_type

# what a checkpoint folder holds besides config.json and the weights, copied as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
GGUF_TYPES = ("f32", "f16")

DECODERS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "granite")
# a norm between a sublayer's projection and the residual add: projecting the projection's weights is
# not projecting what reaches the stream (the norm rescales per token), nor is a bias added before it
POST_NORMS = {"gemma2": "Gemma 2", "gemma3": "Gemma 3", "gemma3_text": "Gemma 3", "olmo2": "OLMo 2"}
POST_NORM_WHY = ("has a norm after the attention output and MLP down projections (post_attention_layernorm, "
                 "post_feedforward_layernorm), which rescales what they write to the residual stream per token, "
                 "so a change baked into those weights is not the same change to the stream")
# transformers' names of the tables whose rows enter the stream and of the two writes of block N
# (weight or bias); GPT-2's projections are Conv1D, (in, out), the others Linear, (out, in)
HF_NAMES = {
    "decoder": (r"(model\.)?embed_tokens\.weight", None,
                r"(model\.)?layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)",
                r"(model\.)?layers\.(\d+)\.mlp\.down_proj\.(weight|bias)"),
    "gpt2": (r"(transformer\.)?wte\.weight", r"(transformer\.)?wpe\.weight",
             r"(transformer\.)?h\.(\d+)\.attn\.c_proj\.(weight|bias)",
             r"(transformer\.)?h\.(\d+)\.mlp\.c_proj\.(weight|bias)"),
}
# the config key switching MLP biases on (GPT-2 always has them; the other decoders' MLPs never do)
MLP_BIAS_KEY = {"llama": "mlp_bias", "granite": "mlp_bias"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma", "granite", "gpt2")
GGUF_POST_NORMS = {"gemma2": "Gemma 2", "gemma3": "Gemma 3", "olmo2": "OLMo 2"}
# llama.cpp reads an optional ffn_down bias for these (GPT-2 files always carry one)
GGUF_STEER_ARCHITECTURES = ("llama", "gpt2")


def hf_family(config):
    """("decoder" or "gpt2", kvwire's config of it); families kvwire cannot bake into raise, by name."""
    model_type = config.get("model_type")
    if model_type in POST_NORMS:
        raise ValueError(f"cannot bake into {POST_NORMS[model_type]} (model type {model_type!r}): it {POST_NORM_WHY}")
    if model_type not in (*DECODERS, "gpt2"):
        raise ValueError(f"kvwire bakes steering into model types {', '.join((*DECODERS, 'gpt2'))}; "
                         f"got model type {model_type!r}")
    return ("gpt2" if model_type == "gpt2" else "decoder"), by_hf_model_type(model_type).config_from_hf(config)


def hf_writes(state, kind, layers):
    """(embedding name, position embedding name or None, attention write names, MLP write names),
    checked: one embedding, and a weight of each write per block."""
    embed, position, attn, mlp = HF_NAMES[kind]
    found = [[n for n in state if re.fullmatch(p, n)] if p else [] for p in (embed, position, attn, mlp)]
    for what, names, want in (("token embedding", found[0], 1), ("attention output projection", found[2], layers),
                              ("MLP down projection", found[3], layers)):
        weights = [n for n in names if n.endswith("weight")]
        if len(weights) != want:
            raise ValueError(f"expected {want} {what} weight(s) in the checkpoint, found {len(weights)}: {weights[:4]}")
    return found[0][0], (found[1] or [None])[0], found[2], found[3]


def read_hf(source):
    """(config dict, state dict {HF name: tensor}, folder or None) of a checkpoint folder or of a
    transformers model object (its own state dict: exactly the tensors transformers loads)."""
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if not folder.is_dir():
            raise ValueError(f"{source} is not a folder; expected a Hugging Face checkpoint folder, a transformers "
                             f"model object or (with format='gguf') a .gguf file")
        return read_config(folder), read_state_dict(folder), folder
    if not hasattr(source, "state_dict") or not hasattr(getattr(source, "config", None), "to_dict"):
        raise TypeError(f"source must be a checkpoint folder, a .gguf file or a transformers model object; "
                        f"got {type(source).__name__}")
    config = source.config.to_dict()
    config["architectures"] = config.get("architectures") or [type(source).__name__]
    return config, {k: v.detach().cpu() for k, v in source.state_dict().items()}, None


def write_hf(out, config, state, folder=None):
    """`out`/config.json and model.safetensors (+ `folder`'s tokenizer files). Returns `out` (a Path)."""
    from safetensors.torch import save_file

    out = Path(out)
    if folder is not None and out.resolve() == Path(folder).resolve():
        raise ValueError(f"out {str(out)!r} is the source folder; write the baked model to another folder")
    out.mkdir(parents=True, exist_ok=True)
    seen, tensors = set(), {}
    for name, t in state.items():  # safetensors refuses tensors that share memory (a tied head)
        t = t.contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        tensors[name] = t.clone() if key in seen else t
        seen.add(key)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES if folder is not None else ():
        if (Path(folder) / name).is_file():
            shutil.copyfile(Path(folder) / name, out / name)
    return out


def open_gguf(path, supported, what):
    """(a `gguf.GGUFReader` over `path`, its architecture, hidden size, block count); architectures
    not in `supported` raise, by name, saying they cannot take `what` ("an ablation", "a steer")."""
    import gguf

    if not Path(path).is_file():
        raise ValueError(f"{path} is not a file; format='gguf' bakes into a copy of a .gguf file")
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch in GGUF_POST_NORMS:
        raise ValueError(f"cannot bake into {path}: {GGUF_POST_NORMS[arch]} ({arch!r}) {POST_NORM_WHY}")
    if arch not in supported:
        raise ValueError(f"cannot bake {what} into {path}: its architecture {arch!r} is not one kvwire bakes "
                         f"{what.split()[-1]}s into (it does for {', '.join(supported)})")
    sizes = []
    for key in (f"{arch}.embedding_length", f"{arch}.block_count"):
        if key not in reader.fields:
            raise ValueError(f"{path} has no metadata key {key!r}; llama.cpp requires it")
        sizes.append(int(reader.fields[key].contents()))
    return reader, arch, *sizes


def dequantized(reader, name):
    """One tensor of `reader` as float32, numpy layout (out, in) (GGUF lists dimensions reversed)."""
    from gguf.quants import dequantize

    t = _tensor({t.name: t for t in reader.tensors}, name, reader)
    return np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"]).reshape(layout(t))


def rewrite_gguf(reader, arch, out, changed, copies=(), tensor_type="f32"):
    """Write `reader`'s file to `out` with the tensors of `changed` stored as `tensor_type`, and
    `copies` ((new name, source name) pairs: a source tensor's raw bytes under another name).
    Everything else is copied as it is. `changed` maps a name to a float32 array in numpy layout,
    or, for a tensor the file has, to a function of nothing returning it (made when it is written,
    so one changed tensor is in memory at a time). Returns `out` (a Path)."""
    import gguf

    if tensor_type not in GGUF_TYPES:
        raise ValueError(f"tensor_type must be one of {GGUF_TYPES}, got {tensor_type!r}")
    if Path(out).resolve() == Path(reader.data.filename).resolve():
        raise ValueError(f"out {str(out)!r} is the source file; write the baked model to another file")
    wide = np.dtype(np.float32 if tensor_type == "f32" else np.float16)

    def store(shape):  # 1-D tensors (biases) stay F32, as llama.cpp's converter keeps them
        return np.dtype(np.float32) if len(shape) == 1 else wide

    writer = gguf.GGUFWriter(str(out), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.contents()))
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tensors = {t.name: t for t in reader.tensors}
    plan = list(tensors.items()) + [(new, _tensor(tensors, src, reader)) for new, src in copies] \
        + [(n, None) for n in changed if n not in tensors]
    for name, t in plan:
        if name in changed:
            shape = np.shape(changed[name]) if t is None else layout(t)
            writer.add_tensor_info(name, shape, store(shape), int(np.prod(shape)) * store(shape).itemsize)
        else:
            writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, t in plan:
        if name in changed:  # computed here, in this machine's byte order
            made = changed[name]() if callable(changed[name]) else changed[name]
            writer.write_tensor_data(np.ascontiguousarray(made, dtype=store(np.shape(made))))
        else:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(out)


def layout(t):
    """A GGUF tensor's shape in numpy layout ((out, in): GGUF lists dimensions reversed)."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _tensor(tensors, name, reader):
    if name not in tensors:
        raise ValueError(f"{reader.data.filename} has no tensor {name!r}")
    return tensors[name]
