"""Export's form of transformers' MoE experts: every expert on every token, weighted by the router
(zero for the experts a token does not pick), registered with transformers' `ExpertsInterface` as
"kvwire_dense".

transformers' own forms index tokens by expert (a loop over the experts hit, or a grouped matmul
whose group sizes come from the routing): shapes that depend on the data, which an ONNX or
ExecuTorch program cannot hold. The dense form has static shapes at E / top_k times the experts'
FLOPs, the price of a program without data-dependent shapes. It is used while `kw.export` traces
(`dense_experts`); eager and compiled steps keep transformers' own form.
"""
from contextlib import contextmanager

import torch

NAME = "kvwire_dense"
_registered = []


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts signature: hidden_states (T, D), top_k_index (T, k) int, top_k_weights
    (T, k) -> (T, D), what its batched form computes (gate, biases, post-expert norm and weight
    layout as the experts module declares them), with every expert run on every token."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    weights = torch.zeros(hidden_states.shape[0], up.shape[0], dtype=top_k_weights.dtype,
                          device=hidden_states.device).scatter_add(1, top_k_index, top_k_weights)  # (T, E)
    out = _linear(hidden_states, up, getattr(self, "gate_up_proj_bias" if self.has_gate else "up_proj_bias", None)
                  if self.has_bias else None, self.is_transposed)  # (E, T, 2I) or (E, T, I)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = _linear(out, self.down_proj, self.down_proj_bias if self.has_bias else None, self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return (out * weights.T[..., None].to(out.dtype)).sum(0).to(hidden_states.dtype)


def _linear(x, weight, bias, transposed):
    """x (T, I) or (E, T, I) through each expert's weight (E, O, I), or (E, I, O) `transposed`,
    and bias (E, O) -> (E, T, O)."""
    y = torch.matmul(x, weight if transposed else weight.transpose(1, 2))
    return y if bias is None else y + bias[:, None, :]


def register():
    """Register "kvwire_dense" with transformers' experts interface (once)."""
    if not _registered:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register(NAME, dense_experts_forward)
        _registered.append(True)


def experts_modules(module):
    """transformers' experts modules under `module` (classes made by `use_experts_implementation`)."""
    return [m for m in module.modules() if all(hasattr(m, a) for a in ("has_gate", "is_transposed", "config"))
            and hasattr(m.config, "_experts_implementation")]


@contextmanager
def dense_experts(module):
    """Inside: every transformers experts module under `module` computes in the dense form (its
    config's `_experts_implementation` is "kvwire_dense", restored after). Yields how many there are."""
    found = experts_modules(module)
    configs = list({id(m.config): m.config for m in found}.values())
    saved = [c._experts_implementation for c in configs]
    if found:
        register()
    try:
        for c in configs:
            c._experts_implementation = NAME
        yield len(found)
    finally:
        for c, value in zip(configs, saved):
            c._experts_implementation = value
