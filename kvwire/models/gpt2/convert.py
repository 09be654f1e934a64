"""GPT-2 converters: Hugging Face state dicts and GGUF files -> kvwire names.

HF GPT-2 stores projections as Conv1D (in, out) and fuses q/k/v into `c_attn`; kvwire uses Linear
(out, in) and separate q/k/v, and calls the attention output `o_proj`. That is the whole list.
"""
import re

import numpy as np
import torch

from ..config import GGUFMetadata
from .config import GPT2Config


def _split_qkv(prefix, weight, bias, out):
    if weight.dim() != 2 or weight.shape[0] % 3 or tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"GPT-2 fused q/k/v of block {prefix[:-1]!r}: weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not split into three equal parts")
    for name, w, b in zip(("q_proj", "k_proj", "v_proj"), weight.chunk(3, 0), bias.chunk(3, 0)):
        out[f"{prefix}attn.{name}.weight"], out[f"{prefix}attn.{name}.bias"] = w, b


def state_from_hf(state, config=None):
    """HF GPT2LMHeadModel/GPT2Model state dict -> backbone state dict."""
    state = {k.removeprefix("transformer."): v for k, v in state.items()
             if k != "lm_head.weight" and not re.search(r"\.attn\.(masked_)?bias$", k)}
    out = {}
    for key, value in state.items():
        m = re.fullmatch(r"(h\.\d+\.)(attn|mlp)\.(c_attn|c_proj|c_fc)\.(weight|bias)", key)
        if not m:
            out[key] = value
            continue
        prefix, part, proj, kind = m.groups()
        if proj == "c_attn":
            if kind == "weight":
                bias = f"{prefix}attn.c_attn.bias"
                _split_qkv(prefix, _matrix(key, value).t(), _partner(state, bias, key, bias), out)
            elif f"{prefix}attn.c_attn.weight" not in state:
                raise ValueError(f"GPT-2 checkpoint has {key!r} but no {prefix}attn.c_attn.weight")
            continue
        name = "o_proj" if (part, proj) == ("attn", "c_proj") else proj
        out[f"{prefix}{part}.{name}.{kind}"] = _matrix(key, value).t() if kind == "weight" else value
    return out


def _matrix(key, value):
    """A Conv1D weight, checked to be a matrix before it is transposed."""
    if value.dim() != 2:
        raise ValueError(f"GPT-2 checkpoint tensor {key!r} has shape {tuple(value.shape)}; expected a matrix")
    return value


_GGUF_BLOCK = {"attn_norm": "ln_1", "attn_output": "attn.o_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GGUF_TOP = {"token_embd.weight": "wte.weight", "position_embd.weight": "wpe.weight",
             "output_norm.weight": "ln_f.weight", "output_norm.bias": "ln_f.bias"}


def state_from_gguf(tensors, config=None):
    """(gguf name, numpy array) pairs -> backbone state dict (GGUF stores (out, in) already)."""
    out, qkv = {}, {}
    for name, array in tensors:
        if name == "output.weight":
            continue
        if name in _GGUF_TOP:
            out[_GGUF_TOP[name]] = array
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if not m:
            raise ValueError(f"unexpected tensor {name!r} in a gpt2 GGUF file")
        i, part, kind = m.groups()
        if part == "attn_qkv":
            qkv[(i, kind)] = array
        elif part in _GGUF_BLOCK:
            out[f"h.{i}.{_GGUF_BLOCK[part]}.{kind}"] = array
        else:
            raise ValueError(f"unexpected tensor {name!r} in a gpt2 GGUF file")
    for (i, kind), array in qkv.items():
        if kind == "weight":
            bias = _partner(qkv, (i, "bias"), f"blk.{i}.attn_qkv.weight", f"blk.{i}.attn_qkv.bias")
            _split_qkv(f"h.{i}.", torch.from_numpy(np.ascontiguousarray(array)),
                       torch.from_numpy(np.ascontiguousarray(bias)), out)
        elif (i, "weight") not in qkv:
            raise ValueError(f"GPT-2 GGUF has blk.{i}.attn_qkv.bias but no blk.{i}.attn_qkv.weight")
    return out


def _partner(tensors, key, have, name):
    """The bias that goes with a fused q/k/v weight (both are split)."""
    if key not in tensors:
        raise ValueError(f"GPT-2 checkpoint has {have!r} but not its fused bias {name!r}")
    return tensors[key]


# the gpt2 keys llama.cpp writes or reads; any other `gpt2.*` key raises (GGUFMetadata)
_GGUF_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
              "attention.head_count", "attention.head_count_kv", "attention.layer_norm_epsilon"}


def config_from_gguf(meta, vocab_size, source="GGUF metadata", file=None):
    """GPT2Config from GGUF metadata (keys llama.cpp requires are required); errors name `source`."""
    m = GGUFMetadata(meta, "gpt2", _GGUF_KEYS, source)
    heads = m.int("attention.head_count")
    if m.int("attention.head_count_kv", heads) != heads:
        m.fail("attention.head_count_kv", f"= {meta['gpt2.attention.head_count_kv']}; GPT-2 has one key/value "
               f"head per query head ({heads})")
    if m.int("vocab_size", vocab_size) != vocab_size:
        m.fail("vocab_size", f"= {meta['gpt2.vocab_size']}, but the tokenizer lists {vocab_size} tokens")
    return GPT2Config(
        vocab_size=vocab_size, n_positions=m.int("context_length"), n_embd=m.int("embedding_length"),
        n_layer=m.int("block_count"), n_head=heads, n_inner=m.int("feed_forward_length"),
        layer_norm_epsilon=m.float("attention.layer_norm_epsilon", 1e-5, strict=False))
