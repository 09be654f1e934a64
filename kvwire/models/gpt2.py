"""GPT-2: its own small backbone (learned positions, LayerNorm, a plain MLP), not the shared
decoder's, whose blocks are rotary and RMSNorm. The family has the same parts as the others: a config
with the checkpoint's names and its mapping, converters, the registration.

Module names follow the HF checkpoint (`wte`, `h.N.attn`, `ln_f`), except that HF's Conv1D (in, out)
projections become Linear (out, in) and the fused `c_attn` becomes q/k/v, with the attention output
called `o_proj`: that is the whole list of renames.
"""
import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..layers import MLP, Attention, Block, LayerNorm, OutputWeight, PositionEmbedding, TiedHead, TokenEmbedding
from ..layers.site import add_sites
from .config import GGUFMetadata, check_fields, read_hf
from .registry import Family, register

_POSITIVE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyper-parameters (HF names). `n_inner` None means 4 * n_embd.

    Example:
        >>> GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100).inner_size
        128
    """

    vocab_size: int = 50_257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    bos_token_id: int = 50_256
    eos_token_id: object = 50_256
    pad_token_id: int = None
    tie_word_embeddings: bool = True  # False: the head has its own matrix (`lm_head`)

    def __post_init__(self):
        check_fields(self, _POSITIVE, layers="n_layer")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if self.layer_norm_epsilon < 0:
            raise ValueError(f"layer_norm_epsilon={self.layer_norm_epsilon}; expected a value >= 0")

    @property
    def hidden_size(self):
        return self.n_embd

    @property
    def max_position_embeddings(self):
        return self.n_positions

    @property
    def inner_size(self):
        return self.n_inner or 4 * self.n_embd


_FIELDS = {f.name for f in dataclasses.fields(GPT2Config)}
_MUST_BE = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "add_cross_attention": False}


def config_from_hf(d):
    """A `GPT2Config` from a Hugging Face config dict (config.json, or `model.config.to_dict()`)."""
    return GPT2Config(**read_hf(d, "gpt2 config", _FIELDS, must_be=_MUST_BE))


class GPT2Block(Block):
    """Pre-norm attention and MLP with residuals. x (B, T, D) -> (B, T, D); sites as
    `kvwire.layers.site.SITES`."""

    def __init__(self, config, layer_idx):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        head_dim = c.n_embd // c.n_head
        self.ln_1 = LayerNorm(c.n_embd, c.layer_norm_epsilon)
        self.attn = Attention(c.n_embd, c.n_head, c.n_head, head_dim, bias=True,
                              scale=head_dim**-0.5 if c.scale_attn_weights else 1.0)
        self.ln_2 = LayerNorm(c.n_embd, c.layer_norm_epsilon)
        self.mlp = MLP(c.n_embd, c.inner_size, c.activation_function)
        add_sites(self)

    def forward(self, x):
        x = self.resid_pre(x)
        x = self.resid_mid(x + self.attn_out(self.attn(self.ln_1(x))))
        return self.block_out(x + self.mlp_out(self.mlp(self.ln_2(x))))


class GPT2Backbone(nn.Module):
    """token_ids (B, T) -> hidden states (B, T, D) after the final LayerNorm.

    Example:
        >>> backbone = GPT2Backbone(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100))
        >>> backbone(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 32])
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = TokenEmbedding(config.vocab_size, config.n_embd)
        self.wpe = PositionEmbedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        if not config.tie_word_embeddings:  # read by the head only, as the shared decoder's
            self.lm_head = OutputWeight(config.vocab_size, config.n_embd)

    def forward(self, token_ids):
        x = self.wpe(self.wte(token_ids))  # wpe adds the learned position vectors
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


def state_from_hf(state, config=None):
    """HF GPT2LMHeadModel/GPT2Model state dict -> backbone state dict."""
    untied = config is not None and not config.tie_word_embeddings
    state = {k.removeprefix("transformer."): v for k, v in state.items()
             if (untied or k != "lm_head.weight") and not re.search(r"\.attn\.(masked_)?bias$", k)}
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


def _split_qkv(prefix, weight, bias, out):
    """The fused q/k/v rows (3 * D, D) and bias (3 * D,) split into q_proj, k_proj, v_proj."""
    if weight.dim() != 2 or weight.shape[0] % 3 or tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"GPT-2 fused q/k/v of block {prefix[:-1]!r}: weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not split into three equal parts")
    for name, w, b in zip(("q_proj", "k_proj", "v_proj"), weight.chunk(3, 0), bias.chunk(3, 0)):
        out[f"{prefix}attn.{name}.weight"], out[f"{prefix}attn.{name}.bias"] = w, b


def _matrix(key, value):
    """A Conv1D weight, checked to be a matrix before it is transposed."""
    if value.dim() != 2:
        raise ValueError(f"GPT-2 checkpoint tensor {key!r} has shape {tuple(value.shape)}; expected a matrix")
    return value


def _partner(tensors, key, have, name):
    """The bias that goes with a fused q/k/v weight (both are split)."""
    if key not in tensors:
        raise ValueError(f"GPT-2 checkpoint has {have!r} but not its fused bias {name!r}")
    return tensors[key]


_GGUF_BLOCK = {"attn_norm": "ln_1", "attn_output": "attn.o_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GGUF_TOP = {"token_embd.weight": "wte.weight", "position_embd.weight": "wpe.weight",
             "output_norm.weight": "ln_f.weight", "output_norm.bias": "ln_f.bias"}


def state_from_gguf(tensors, config=None):
    """(gguf name, numpy array) pairs -> backbone state dict (GGUF stores (out, in) already)."""
    out, qkv = {}, {}
    untied = config is not None and not config.tie_word_embeddings
    for name, array in tensors:
        if name == "output.weight":
            if untied:  # its own head (a fine-tuned or baked model): kept, not replaced by token_embd
                out["lm_head.weight"] = array
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
        layer_norm_epsilon=m.float("attention.layer_norm_epsilon", 1e-5, strict=False),
        tie_word_embeddings=file is None or "output.weight" not in file.tensor_names)


FAMILY = register(Family(
    name="gpt2", hf_model_types=("gpt2",), gguf_architecture="gpt2", config_cls=GPT2Config,
    config_from_hf=config_from_hf, backbone=GPT2Backbone,
    head=lambda backbone: TiedHead(backbone.wte if backbone.config.tie_word_embeddings else backbone.lm_head),
    state_from_hf=state_from_hf, state_from_gguf=state_from_gguf, config_from_gguf=config_from_gguf))
