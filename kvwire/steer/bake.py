"""Steering baked into a checkpoint's weights, so that any runtime (transformers, llama.cpp) runs
the steered model with no steering code: a directional ablation at every residual write
(`bake_ablation`, the "weight orthogonalisation" of arXiv 2406.11717) and an additive block-output
steer in the MLP's output bias (`bake_steer`). Both read a Hugging Face folder or transformers
model object (writing a folder with transformers' own tensor names) or a GGUF file (writing a GGUF
llama.cpp loads). docs/bake.md has the math and the families refused, and why.
"""
import math
import re

import numpy as np
import torch

from . import bake_io
from .layer import as_vector
from .ops import Ablate
from .vector import ControlVector

FORMATS = ("safetensors", "gguf")


def bake_ablation(source, directions, out, *, strength=1.0, format="safetensors", tensor_type=None):
    """Write a copy of `source` whose weights project `directions` out of everything written to the
    residual stream: `x - s Q^T Q x` with Q (K, D) an orthonormal basis of the directions' span, baked
    into the token embedding rows (E - s E Q^T Q; GPT-2's position embedding too), each attention
    output projection and each MLP down projection (W - s Q^T Q W, biases likewise). A tied output
    head is untied and keeps the original embedding, so the logits are the steered model's.

    The baked model equals `lm.ablate(d, layers=[0], site="resid_pre").ablate(d, site="attn_out")
    .ablate(d, site="mlp_out")`; families with a norm after those projections (Gemma 2/3, OLMo 2)
    are refused.

    Args:
        source: a Hugging Face checkpoint folder or a transformers model object (format
            "safetensors"), or a .gguf file (format "gguf").
        directions: a (D,) or (K, D) tensor or list; linearly independent rows, D the hidden size.
        out: the folder to write (config.json, model.safetensors, the source folder's tokenizer
            files) or the .gguf file.
        strength: s, a number (1: the component is removed; 0: the weights are unchanged).
        format: "safetensors" or "gguf".
        tensor_type: GGUF only: "f32" (default) or "f16", how the changed matrices are stored (their
            source blocks are dequantised). A tied file gets `output.weight`, a copy of the original
            embedding's own blocks; every other tensor and all metadata are copied unchanged.

    Returns `out` as a Path.

    Example:
        >>> bake_ablation("SmolLM2-135M", refusal_direction, "SmolLM2-135M-abliterated")
        >>> bake_ablation("smollm2.Q4_1.gguf", refusal_direction, "abliterated.gguf", format="gguf")
    """
    s = _number(strength, "strength")
    if isinstance(directions, (ControlVector, dict)):
        raise TypeError("bake_ablation takes one (D,) or (K, D) tensor, projected out at every residual write; "
                        "pick a block's direction, e.g. vec.directions[12]")
    if _format(format, tensor_type) == "gguf":
        return _ablate_gguf(source, directions, out, s, tensor_type or "f32")
    config, state, folder = bake_io.read_hf(source)
    kind, c = bake_io.hf_family(config)
    q = _basis(directions, c.hidden_size)
    embed, position, attn, mlp = bake_io.hf_writes(state, kind, _layers(c))
    if getattr(c, "tie_word_embeddings", True):  # GPT-2's config has no such field: always tied
        state["lm_head.weight"] = state[embed].clone()
        config["tie_word_embeddings"] = False
    for name in filter(None, (embed, position)):
        state[name] = _project(state[name], q, s, -1)
    for name in (*attn, *mlp):  # a Linear weight is (D, in); a Conv1D weight and a bias end in D
        state[name] = _project(state[name], q, s, 0 if kind != "gpt2" and name.endswith("weight") else -1)
    return bake_io.write_hf(out, config, state, folder)


def bake_steer(source, vector, strength, out, *, add_bias=False, format="safetensors"):
    """Write a copy of `source` that adds `strength * v_N` to the output of each block N of
    `vector`, baked into block N's MLP output bias (the MLP's write is the block's last, so adding
    to it adds to the block's output; Granite's bias gets v / residual_multiplier).

    Biases: GPT-2 has them; Llama and Granite when their config's `mlp_bias` is true. With
    `add_bias=True` a Llama or Granite config without them is switched to `mlp_bias: true`, and
    every MLP projection gets a bias (zero but the steered ones). transformers' Mistral, Qwen 2/3,
    Phi-3 and Gemma MLPs have no bias, and Gemma 2/3 and OLMo 2 have a norm after the MLP: all are
    refused. GGUF: llama files (llama.cpp reads an optional `blk.N.ffn_down.bias`) and gpt2 files.

    Args:
        source: as `bake_ablation`.
        vector: a `kw.ControlVector` for operation "add" at "block_out" (or "mlp_out": the same
            sum), or a {block: (D,) tensor} dict.
        strength: a number.
        out: as `bake_ablation`.
        add_bias: switch MLP biases on where the family's config can (see above).
        format: as `bake_ablation` (a GGUF stores the biases as F32).

    Returns `out` as a Path.

    Example:
        >>> bake_steer("Llama-folder", happy, 4.0, "Llama-happy", add_bias=True)
    """
    s = _number(strength, "strength")
    if _format(format) == "gguf":
        return _steer_gguf(source, vector, s, out)
    config, state, folder = bake_io.read_hf(source)
    kind, c = bake_io.hf_family(config)
    per_block = _per_block(vector, c.hidden_size, _layers(c))
    model_type = config["model_type"]
    key = bake_io.MLP_BIAS_KEY.get(model_type)
    has_bias = kind == "gpt2" or (key is not None and c.mlp_bias)
    if not has_bias and not (add_bias and key):
        raise ValueError(_no_bias(model_type, key))
    *_, mlp = bake_io.hf_writes(state, kind, _layers(c))
    biases = {int(re.search(r"\.(\d+)\.", n).group(1)): n[:-len("weight")] + "bias"
              for n in mlp if n.endswith("weight")}
    if not has_bias:  # every MLP projection of every block gets a bias, as transformers builds them with mlp_bias
        config[key] = True
        for name in [n for n in state if re.fullmatch(r"(model\.)?layers\.\d+\.mlp\.\w+_proj\.weight", n)]:
            state[name[:-len("weight")] + "bias"] = torch.zeros(state[name].shape[0], dtype=state[name].dtype)
    scale = s / getattr(c, "residual_multiplier", 1.0)  # Granite scales the MLP's write, bias included
    for i, v in per_block.items():
        bias = state[biases[i]]
        state[biases[i]] = (bias.float() + scale * v).to(bias.dtype)
    return bake_io.write_hf(out, config, state, folder)


def _ablate_gguf(source, directions, out, s, tensor_type):
    reader, arch, width, layers = bake_io.open_gguf(source, bake_io.GGUF_ARCHITECTURES, "an ablation")
    q = _basis(directions, width)
    names = {t.name for t in reader.tensors}
    writes = [f"blk.{i}.{w}.{kind}" for i in range(layers) for w in ("attn_output", "ffn_down")
              for kind in ("weight", "bias")]
    missing = [n for n in ("token_embd.weight", *writes) if n not in names and not n.endswith("bias")]
    if missing:
        raise ValueError(f"{source} has no tensor {missing[0]!r}; a {arch} file has one per block")

    def projected(name, dim):  # made when written: one dequantised tensor in memory at a time
        return lambda: _project(torch.from_numpy(bake_io.dequantized(reader, name)), q, s, dim).numpy()

    changed = {n: projected(n, -1) for n in ("token_embd.weight", "position_embd.weight") if n in names}
    changed.update({n: projected(n, 0 if n.endswith("weight") else -1) for n in writes if n in names})
    copies = [] if "output.weight" in names else [("output.weight", "token_embd.weight")]
    return bake_io.rewrite_gguf(reader, arch, out, changed, copies, tensor_type)


def _steer_gguf(source, vector, s, out):
    reader, arch, width, layers = bake_io.open_gguf(source, bake_io.GGUF_STEER_ARCHITECTURES, "a steer")
    names = {t.name for t in reader.tensors}
    changed = {}
    for i, v in _per_block(vector, width, layers).items():
        name = f"blk.{i}.ffn_down.bias"
        bias = bake_io.dequantized(reader, name) if name in names else np.zeros(width, np.float32)
        changed[name] = bias + s * v.numpy()
    return bake_io.rewrite_gguf(reader, arch, out, changed)


def _no_bias(model_type, key):
    if key is not None:
        return (f"this {model_type} checkpoint has no MLP biases ({key}: false), so there is no bias to bake the "
                f"steer into; add_bias=True sets {key}: true and gives every MLP projection a bias (zero but the "
                f"steered blocks'), which transformers loads as it is")
    return (f"transformers' {model_type} MLP has no bias, and its config has no switch for one: there is nothing to "
            f"bake an added vector into (steer at run time, or bake into a llama, granite or gpt2 checkpoint)")


def _format(format, tensor_type=None):
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if tensor_type is not None and (format != "gguf" or tensor_type not in bake_io.GGUF_TYPES):
        raise ValueError(f"tensor_type is for format='gguf' only, one of {bake_io.GGUF_TYPES}; got "
                         f"tensor_type={tensor_type!r} with format={format!r}")
    return format


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _layers(c):
    return getattr(c, "num_hidden_layers", None) or c.n_layer


def _basis(directions, width):
    """Q (K, D) float32, orthonormal rows spanning `directions` (checked as `Ablate` checks them)."""
    q = Ablate(directions).basis
    if q.shape[1] != width:
        raise ValueError(f"directions have width {q.shape[1]}, but the model's hidden size is {width}")
    return q


def _per_block(vector, width, layers):
    """{block: (D,) float32} from a ControlVector (added at block_out or mlp_out) or a {block: tensor} dict."""
    if isinstance(vector, ControlVector):
        if vector.operation != "add" or vector.site not in ("block_out", "mlp_out"):
            raise ValueError(f"bake_steer bakes a vector added at block_out (or mlp_out); this one is made to "
                             f"{vector.operation} at {vector.site}")
        vector = vector.directions
    if not isinstance(vector, dict) or not vector:
        raise TypeError(f"vector must be a kw.ControlVector or a non-empty {{block: (D,) tensor}} dict; "
                        f"got {type(vector).__name__}")
    out = {int(i): as_vector(v, torch.device("cpu"), f"control vector block {i}") for i, v in vector.items()}
    for i, v in out.items():
        if v.numel() != width:
            raise ValueError(f"control vector width {v.numel()} does not fit the model's hidden size {width}")
        if not 0 <= i < layers:
            raise ValueError(f"control vector steers block {i}, but the model has blocks 0-{layers - 1}")
    return out


def _project(x, q, s, dim):
    """x - s Q^T Q x along `dim` (the residual width): the last of an embedding, a bias or a Conv1D
    weight (in, D); the first of a Linear weight (D, in). Computed in float32, stored in x's dtype."""
    xf = x.to(torch.float32).movedim(dim, -1)
    return (xf - s * (xf @ q.T) @ q).movedim(-1, dim).to(x.dtype).contiguous()
