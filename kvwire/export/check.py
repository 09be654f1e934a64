"""Naming what an exporter could not represent: which layer call, which operation, which runtime."""
import re

import torch

RUNTIMES = {"onnx": "ONNX", "executorch": "ExecuTorch", "coreml": "Core ML"}
_NODE = re.compile(r"target=torch\.ops\.([\w.]+)")


class ExportFailure(RuntimeError):
    """An exporter refused the graph; the message names the layer, the operation and the runtime."""


def describe_failure(prog, fmt, error, ep=None):
    """ExportFailure naming the layer whose operation the exporter refused (when it can be found)."""
    text = f"{type(error).__name__}: {error}"
    runtime = RUNTIMES.get(fmt, fmt)
    op, layer = _failed_node(ep, text) if ep is not None else (None, None)
    if layer is None:
        layer = _mentioned_layer(prog, text)
    head = f"export to {runtime} failed"
    if layer:
        kind = type(prog.body.get_submodule(layer)).__name__ if _has(prog.body, layer) else "layer"
        head += f" in layer {layer!r} ({kind})"
    if op:
        head += f": operation {op} has no {runtime} translation"
        return ExportFailure(head)
    summary = next((line for line in str(error).splitlines() if "Exception summary" not in line and line.strip()),
                   type(error).__name__)
    return ExportFailure(f"{head}: {type(error).__name__}: {summary[:300].rstrip('.')}{_chunk_fixed(prog, text)}")


def _chunk_fixed(prog, text):
    """Where the trace made the dynamic chunk length a constant: what in the program keeps a state
    over a chunk (a mixer continuing it token by token in Python unrolls its loop), and what to
    export instead. "" for other failures."""
    if "(chunk)" not in text or "specialized it to be a constant" not in text:
        return ""
    keeping = [(name, m) for name, m in prog.body.named_modules() if getattr(m, "states", None) is not None]
    where = ""
    if keeping:
        mixers = sorted({type(m.mixer).__name__ for _, m in keeping
                         if isinstance(getattr(m, "mixer", None), torch.nn.Module)})
        named = f"; {', '.join(mixers)}" if mixers else ""
        where = (f", likely in the layers keeping state ({', '.join(repr(n) for n, _ in keeping)}{named}), whose "
                 f"code loops over a chunk's tokens in Python")
    return (f". The chunk length became a constant while tracing{where}: a dynamic-chunk program cannot hold it; "
            f"export fixed chunk lengths instead (ExecuTorch or Core ML with prefill_length)")


def _failed_node(ep, text):
    """(op, layer) of the node the ONNX translator reported, from the exported graph's module stack."""
    m = _NODE.search(text)
    if not m:
        return None, None
    op = m.group(1)
    for node in ep.graph.nodes:
        if node.op == "call_function" and str(node.target) == op:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            paths = [path for path, _ in stack if path]
            layer = paths[-1].removeprefix("body.") if paths else None
            return op, layer
    return op, None


def _mentioned_layer(prog, text):
    names = {name for name, _ in prog.body.named_modules() if name}
    found = [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]
    return max(found, key=len) if found else None


def _has(module, name):
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False
