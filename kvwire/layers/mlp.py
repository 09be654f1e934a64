"""Feed-forward layers: GPT-2's MLP and the gated MLP (SwiGLU of Llama, GeGLU of Gemma)."""
import torch
from torch import nn

from ..kernels import cpu
from ..kernels.native import fused
from ..kernels.products import siblings
from .base import Layer
from .linear import Linear

_ACTIVATIONS = {
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu": nn.functional.gelu,
    "silu": nn.functional.silu,
    "swish": nn.functional.silu,
    "relu": nn.functional.relu,
}


# the activations `native.fused` computes together with the gate's product, by function: a replaced
# `act` (an edit) runs as it is
_ONE_PASS = {_ACTIVATIONS["gelu_new"]: "gelu_tanh", _ACTIVATIONS["gelu_pytorch_tanh"]: "gelu_tanh",
             nn.functional.silu: "silu"}


def activation(name):
    """The activation function called `name` in Hugging Face configs."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class MLP(Layer):
    """GPT-2's feed-forward: c_proj(act(c_fc(x))). x (B, T, D) -> (B, T, D)."""

    def __init__(self, dim, hidden, act="gelu_new"):
        super().__init__()
        self.c_fc = Linear(dim, hidden)
        self.c_proj = Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GatedMLP(Layer):
    """Gated feed-forward: down_proj(act(gate_proj(x)) * up_proj(x)). x (B, T, D) -> (B, T, D).
    `bias`: biases on all three projections (Llama's `mlp_bias`); `out_bias`: down_proj's (None =
    `bias`; a GGUF's baked steer gives only some blocks one). Eager calls with tanh-GELU or SiLU
    compute act(gate) * up in one pass where `cpu.fused()` is "kvwire" (`native.fused`)."""

    def __init__(self, dim, hidden, act="gelu_pytorch_tanh", bias=False, out_bias=None):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=bias)
        self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias if out_bias is None else out_bias)
        self.act = activation(act)

    def forward(self, x):
        gate, up = siblings(x, (self.gate_proj, self.up_proj))
        if not (torch.compiler.is_compiling() or torch.jit.is_tracing()):  # compilers fuse the plain ops
            kind = _ONE_PASS.get(self.act)
            if kind is not None and cpu.fused() == "kvwire" and fused.applies_gated(gate, up):
                return self.down_proj(fused.gated(kind, gate, up))
        return self.down_proj(self.act(gate) * up)
