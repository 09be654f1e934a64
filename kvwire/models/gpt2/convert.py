"""GPT-2 converters: Hugging Face state dicts and GGUF files -> kvwire names.

HF GPT-2 stores projections as Conv1D (in, out) and fuses q/k/v into `c_attn`; kvwire uses Linear
(out, in) and separate q/k/v, and calls the attention output `o_proj`. That is the whole list.
"""
import re

import numpy as np
import torch

from .config import GPT2Config


def _split_qkv(prefix, weight, bias, out):
    for name, w, b in zip(("q_proj", "k_proj", "v_proj"), weight.chunk(3, 0), bias.chunk(3, 0)):
        out[f"{prefix}attn.{name}.weight"], out[f"{prefix}attn.{name}.bias"] = w, b


def state_from_hf(state):
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
                _split_qkv(prefix, value.t(), state[f"{prefix}attn.c_attn.bias"], out)
            continue
        name = "o_proj" if (part, proj) == ("attn", "c_proj") else proj
        out[f"{prefix}{part}.{name}.{kind}"] = value.t() if kind == "weight" else value
    return out


_GGUF_BLOCK = {"attn_norm": "ln_1", "attn_output": "attn.o_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GGUF_TOP = {"token_embd.weight": "wte.weight", "position_embd.weight": "wpe.weight",
             "output_norm.weight": "ln_f.weight", "output_norm.bias": "ln_f.bias"}


def state_from_gguf(tensors):
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
            _split_qkv(f"h.{i}.", torch.from_numpy(np.ascontiguousarray(array)),
                       torch.from_numpy(np.ascontiguousarray(qkv[(i, "bias")])), out)
    return out


def config_from_gguf(meta, vocab_size):
    a = "gpt2."
    return GPT2Config(
        vocab_size=vocab_size, n_positions=meta[a + "context_length"], n_embd=meta[a + "embedding_length"],
        n_layer=meta[a + "block_count"], n_head=meta[a + "attention.head_count"],
        n_inner=meta.get(a + "feed_forward_length"),
        layer_norm_epsilon=meta.get(a + "attention.layer_norm_epsilon", 1e-5))
