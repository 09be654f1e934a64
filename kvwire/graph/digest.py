"""A digest of what a module computes apart from its tensors' values: the code it runs and every
setting that could shape a trace of it. Two modules with the same digest trace to the same program
when given tensors of the same shapes, so a program compiled for one can be fed the other's weights
(`generate.ahead` keys its saved AOTInductor steps on it).

What goes in, per submodule: the class (and, for a class outside torch, transformers and kvwire,
its source), a graph module's code, its plain settings (numbers, strings, dtypes, tuples of them;
other objects by type), and the name, shape, stride and dtype of every parameter, buffer and tensor
attribute (a steering vector or an edit's constant: values are inputs of the program, not part of
it), save where a compiler writes a tensor's values into its code (`inlined`: 0-d, or at most 8
elements in 1-d): those values go in too. Then the sources of kvwire itself and the versions of
Python, torch and transformers. A module whose code cannot be read (a class defined in an
interactive session) has no digest: None.
"""
import hashlib
import importlib.metadata
import inspect
import json
import sys
from pathlib import Path

import torch
from torch import nn

_LIBRARIES = ("torch", "transformers", "kvwire", "builtins")
_SKIP = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)
_SOURCES = {}  # kvwire's own source digest, once per process


def module_digest(module):
    """sha256 hex of `module`'s structure (see the module docstring), or None where a class's
    source cannot be read.

    Example:
        >>> module_digest(nn.Linear(4, 2)) == module_digest(nn.Linear(4, 2))  # other weights, same digest
        True
    """
    parts = [sys.version_info[:3], torch.__version__, _version("transformers"), kvwire_sources()]
    for name, sub in module.named_modules(remove_duplicate=False):
        kind = type(sub)
        part = [name, f"{kind.__module__}.{kind.__qualname__}"]
        if not kind.__module__.split(".")[0] in _LIBRARIES:
            try:
                part.append(inspect.getsource(kind))
            except (OSError, TypeError):
                return None
        if isinstance(sub, torch.fx.GraphModule):
            part.append(sub.code)
        for key, value in sorted(vars(sub).items()):
            if key in _SKIP or key.startswith("_forward") or key.startswith("_backward") or "hook" in key:
                continue
            if isinstance(value, torch.Tensor):
                part.append([key, _tensor(value)])
            elif not isinstance(value, nn.Module):
                part.append([key, _setting(value)])
        for key, t in [*sub._parameters.items(), *sub._buffers.items()]:
            part.append([key, None if t is None else _tensor(t)])
        parts.append(part)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def kvwire_sources():
    """sha256 hex of kvwire's own files (Python and C): a changed layer changes every digest."""
    if "kvwire" not in _SOURCES:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCES["kvwire"] = h.hexdigest()
    return _SOURCES["kvwire"]


def _tensor(t):
    out = [list(t.shape), list(t.stride()), str(t.dtype), t.device.type]
    if inlined(t):  # its values are written into a compiled program
        out.append(t.detach().cpu().tolist())
    return out


def inlined(t):
    """Whether Inductor writes `t`'s values into the code it compiles instead of reading the tensor
    (a 0-d tensor, or 1-d of at most 8 elements): two modules differing there compile differently."""
    return t.dim() == 0 or (t.dim() == 1 and t.shape[0] <= 8)


def _setting(value, depth=0):
    """A setting as JSON: plain values as they are, containers element by element, functions by
    name, anything else by its type."""
    if isinstance(value, _PLAIN):
        return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    if isinstance(value, (tuple, list)) and depth < 3:
        return [_setting(v, depth + 1) for v in value]
    if isinstance(value, dict) and depth < 3:
        return [[str(k), _setting(v, depth + 1)] for k, v in value.items()]
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
