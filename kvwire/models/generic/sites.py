"""The sites inside a transformers decoder layer, found by watching it run, and edited through hooks.

A generic block is one call of the layer graph (transformers' own layer), so its inner sites are
reached inside the call: each is a module of the layer whose output (or input) *is* the site's
value, found once on the build's probe by dataflow, never by name:
- "attn_out": what attention (or, in a layer without, the recurrent or state-space mixer that keeps
  its state: `kvwire.models.generic.state`) writes to the residual stream: that module's output, or
  the output of the module that takes exactly that tensor next (a post-attention norm, Gemma's sandwich);
- "mlp_out": the output of the layer's last module call (the MLP or MoE block, or its post-norm);
  both only where the layer's output is its input plus those two writes (checked on the probe);
- "resid_mid": the stream between them, where the first module after the attention write reads
  input + attention write (not in blocks that run attention and MLP side by side);
- "attn_heads": the input of the attention's last linear call (its output projection), (B, T,
  heads * value size);
- "resid_pre": the layer's input (edited before the call; no hook).
Each found module gets one permanent hook that does nothing unless the running `DecoderLayer`
carries edits there (a per-thread variable says which): other models sharing the weights, and the
unedited model itself, run as before.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .scoped import Scoped

_running = Scoped(None)
HOOKED = "_kvwire_site_hook"  # attribute marking a module that has its hook (installed once)
TOLERANCE = 1e-4


@dataclass
class Running:
    """One call of an edited generic block: the layer (its edit chains), its input and the call's
    positions and runtime inputs (None for a plain call)."""

    layer: nn.Module
    x: torch.Tensor
    positions: torch.Tensor = None
    inputs: dict = None
    gate: torch.Tensor = None


@contextmanager
def running(layer, x, positions, inputs, gate=None):
    token = _running.set(Running(layer, x, positions, inputs, gate))
    try:
        yield
    finally:
        _running.reset(token)


def find_sites(layer, attention, x, args, kwargs, with_heads=True):
    """({site: (module, "output" | "input")}, heads width or None) for transformers decoder layer
    `layer` (attention module `attention`: its token mixer, or a recurrent one's with `with_heads`
    False, which has no "attn_heads"), by running it once on its recorded call (x, args, kwargs)
    and watching its modules' inputs and outputs."""
    calls, heads = [], []
    child_of = {}
    for name, child in layer.named_children():
        for m in child.modules():
            child_of.setdefault(id(m), child)

    def seen(module, a, kw, out):
        given = a[0] if a else kw.get("hidden_states")
        calls.append((module, given, out[0] if isinstance(out, tuple) else out))

    hooks = [c.register_forward_hook(seen, with_kwargs=True) for c in layer.children()]
    linears = [m for m in attention.children() if isinstance(m, nn.Linear)] if attention is not None and with_heads \
        else []
    hooks += [m.register_forward_hook(lambda m, a, o: heads.append((m, a[0]))) for m in linears]
    try:
        with torch.no_grad():
            y = layer(x, *args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    y = y[0] if isinstance(y, tuple) else y
    found = {}
    if heads and heads[-1][0].out_features == x.shape[-1]:
        found["attn_heads"] = (heads[-1][0], "input")
    at = next((k for k, (m, _, _) in enumerate(calls) if m is child_of.get(id(attention))), None)
    if at is None or not all(isinstance(out, torch.Tensor) for _, _, out in calls):
        return found, _width(found)
    write = at
    if at + 1 < len(calls) and calls[at + 1][1] is calls[at][2] and calls[at + 1][2].shape == x.shape:
        write = at + 1  # a norm on exactly what attention returned: its output is the write
    attn_w, last = calls[write][2], len(calls) - 1
    if last <= write or attn_w.shape != x.shape or calls[last][2].shape != x.shape:
        return found, _width(found)
    mlp_w = calls[last][2]
    if _close(x + attn_w + mlp_w, y):
        found["attn_out"] = (calls[write][0], "output")
        found["mlp_out"] = (calls[last][0], "output")
        if isinstance(calls[write + 1][1], torch.Tensor) and _close(calls[write + 1][1], x + attn_w):
            found["resid_mid"] = (calls[write][0], "output")
    return found, _width(found)


def _width(found):
    return found["attn_heads"][0].in_features if "attn_heads" in found else None


def install(found):
    """Give each module of `found` ({site: (module, kind)}) its hook, once per module."""
    for module, kind in found.values():
        if getattr(module, HOOKED, False):
            continue
        if kind == "input":
            module.register_forward_pre_hook(_edit_input)
        else:
            module.register_forward_hook(_edit_output)
        setattr(module, HOOKED, True)


def _edit_input(module, args):
    run = _running.get()
    if run is None or not args:
        return None
    sites = [s for s, (m, kind) in run.layer.points.items() if m is module and kind == "input"]
    if not sites:
        return None
    x = args[0]
    for site in sites:
        x = run.layer.edit_at(site, x, run.positions, run.inputs, run.gate)
    return (x, *args[1:])


def _edit_output(module, args, out):
    run = _running.get()
    if run is None:
        return None
    sites = [s for s, (m, kind) in run.layer.points.items() if m is module and kind == "output"]
    if not sites:
        return None
    w = out[0] if isinstance(out, tuple) else out
    layer = run.layer
    for site in ("attn_out", "mlp_out"):
        if site in sites:
            w = layer.edit_at(site, w, run.positions, run.inputs, run.gate)
    if "resid_mid" in sites and "resid_mid" in layer.edits:  # the stream x + w, edited, less x
        w = layer.edit_at("resid_mid", run.x + w, run.positions, run.inputs, run.gate) - run.x
    return (w, *out[1:]) if isinstance(out, tuple) else w


def _close(a, b):
    a, b = a.float(), b.float()
    return a.shape == b.shape and bool(((a - b).abs().max() <= TOLERANCE * max(1.0, b.abs().max().item())).item())
