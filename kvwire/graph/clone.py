"""`kw.clone`: rebuild a layer graph, letting a function decide what every layer call produces."""
import contextvars

import torch
from torch import fx

from .release import owned
from .trace import LayerTracer, layer_calls, remember_blocks, trace

_CALL = contextvars.ContextVar("kvwire_call", default=None)


def current_call():
    """Dotted name of the layer call a `clone` fn is running for (None outside clone).

    Example:
        >>> kw.clone(backbone, lambda layer, x: print(current_call()) or layer(x))
    """
    return _CALL.get()


def _identity(layer, *args, **kwargs):
    return layer(*args, **kwargs)


class _Replayer(fx.Interpreter):
    """Runs a traced graph on fx proxies, routing each layer call through `fn`."""

    def __init__(self, root, graph, fn, tracer):
        super().__init__(root, graph=graph)
        self.fn, self.tracer = fn, tracer

    def call_module(self, target, args, kwargs):
        self.tracer.site = target
        token = _CALL.set(target)
        try:
            return self.fn(self.fetch_attr(target), *args, **kwargs)
        finally:
            _CALL.reset(token)
            self.tracer.site = None


def _replay_root(gm, run):
    """A module holding gm's children and attributes, whose forward has gm's input names."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    namespace = {}
    params = ", ".join(names)
    # fx reads the forward's signature to name the graph inputs, so keep the original names.
    exec(f"def forward(self, {params}):\n    return self._run({params})\n", namespace)
    cls = type(type(gm).__name__, (torch.nn.Module,), {"forward": namespace["forward"]})
    root = cls()
    for name, child in gm.named_children():
        root.add_module(name, child)
    for name, value in vars(gm).items():
        if isinstance(value, torch.Tensor):  # fx constants kept as plain attributes
            setattr(root, name, value)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, b)
    object.__setattr__(root, "_run", run)
    return root


def clone(module, fn=None, *, depth="block"):
    """Rebuild `module`'s layer graph, calling `fn(layer, *args, **kwargs)` at every layer call.

    `fn` receives the layer object and the call's (symbolic) inputs and returns what the call should
    produce: call the layer (identity), wrap it, skip it, or call new layers. It runs once per call
    site while the graph is rebuilt, so it may branch on *which* layer it sees, not on tensor values;
    `kvwire.graph.current_call()` gives the call's dotted name. Ready-made fns: `kw.insert_after`,
    `kw.insert_before`, `kw.replace`, `kw.skip` (see `kvwire.graph.edit`).
    New modules it calls are registered in the result (named `<site>__<Class>`); original weights
    are shared, never copied; graph inputs are kept as they are.

    Args:
        module: an `nn.Module` (a backbone or an earlier clone).
        fn: the call function; None means identity.
        depth: "block" (default: embeddings, decoder blocks, final norm) or "layer" (finer).

    Returns a `torch.fx.GraphModule`, which can be cloned again, cached with `with_cache`,
    plotted and exported.

    Example:
        >>> v = torch.randn(640)
        >>> def add_after_block_3(layer, x):
        ...     y = layer(x)
        ...     return y + v if layer is backbone.layers[3] else y
        >>> edited = kw.clone(backbone, add_after_block_3)
    """
    fn = _identity if fn is None else fn
    if not callable(fn):
        raise TypeError(f"clone's fn must be callable, got {type(fn).__name__}")
    gm = trace(module, depth=depth)
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:  # edits check their selectors against the calls that exist
        prepare(gm, [n.target for n in layer_calls(gm)])
    tracer = LayerTracer(depth)
    root = _replay_root(gm, lambda *args: _Replayer(root, gm.graph, fn, tracer).run(*args))
    graph = tracer.trace(root)
    result = remember_blocks(owned(fx.GraphModule(root, graph, class_name=type(gm).__name__)), gm)
    result.meta["kvwire_inserted"] = list(tracer.added)
    return result
