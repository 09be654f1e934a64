"""`kw.trace`: a torch.fx graph of a module at layer granularity, with stable dotted names."""
import torch
from torch import fx

from ..layers.base import Block, Layer
from .release import owned

DEPTHS = ("block", "layer")


class LayerTracer(fx.Tracer):
    """fx tracer whose leaves are kvwire layers at the chosen depth.

    depth="block": every `Layer` (embedding, decoder block, final norm) is one call.
    depth="layer": blocks are opened; attention, MLP and norms are the calls.
    Modules not yet in the traced root (created by a `clone` fn) are leaves and get registered.
    """

    def __init__(self, depth="block"):
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"depth must be one of {DEPTHS}, got {depth!r}")
        self.depth = depth
        self.site = None  # dotted name of the layer call a clone fn is running for
        self.added = []  # names of modules registered during this trace

    def is_leaf_module(self, m, qualname):
        if isinstance(m, Layer):
            return self.depth == "block" or not isinstance(m, Block) or m.opaque
        if speaks_protocol(m):  # a plain module asking for positions, caches or runtime inputs
            return True
        if not self._registered(m):
            return True
        return super().is_leaf_module(m, qualname)

    def _registered(self, m):
        return bool(self.submodule_paths) and m in self.submodule_paths

    def path_of_module(self, mod):
        if self._registered(mod) or not self.submodule_paths:
            return super().path_of_module(mod)
        name = self._fresh_name(mod)
        self.root.add_module(name, mod)
        self.submodule_paths[mod] = name
        self.added.append(name)
        return name

    def _fresh_name(self, mod):
        # named after the original call it follows: after `layers_1_block_out__Steer` (itself put
        # after layers.1.block_out) comes `layers_1_block_out__Steer_1`, not a growing chain of names
        stem = f"{(self.site or 'root').replace('.', '_').split('__')[0]}__{type(mod).__name__}"
        existing = dict(self.root.named_children())
        name, i = stem, 1
        while name in existing:
            name, i = f"{stem}_{i}", i + 1
        return name


def speaks_protocol(module):
    """Whether a module that is not a kvwire `Layer` asks the cache pass for positions, a cache or
    runtime inputs (the protocol of `kvwire.layers.base`); it must then be called as one layer, so
    it needs `forward_cached` (and `runtime_defaults` for runtime inputs)."""
    wants = [attr for attr in ("uses_positions", "runtime_inputs", "cache_spec") if getattr(module, attr, None)]
    if not wants:
        return False
    missing = [m for m in ("forward_cached",) + (("runtime_defaults",) if "runtime_inputs" in wants else ())
               if not callable(getattr(module, m, None))]
    if missing:
        raise TypeError(f"{type(module).__name__} sets {', '.join(wants)} but has no {' or '.join(missing)}; "
                        f"a layer that speaks the cache protocol defines forward_cached (see kvwire.layers.base) "
                        f"or subclasses kvwire.layers.base.Layer")
    return True


def trace(module, depth="block"):
    """Trace `module` into a `torch.fx.GraphModule` whose calls are layers at `depth`.

    Args:
        module: an `nn.Module` (a backbone, or the result of `clone`).
        depth: "block" (embeddings, decoder blocks, final norm) or "layer" (attention, MLP, norms).

    Returns a GraphModule sharing `module`'s weights; call nodes are named by dotted module path.

    Example:
        >>> gm = kw.trace(backbone)
        >>> [n.target for n in gm.graph.nodes if n.op == "call_module"][:2]
        ['embed_tokens', 'layers.0']
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"trace expects an nn.Module, got {type(module).__name__}")
    tracer = LayerTracer(depth)
    graph = tracer.trace(module)
    return remember_blocks(owned(fx.GraphModule(module, graph, class_name=type(module).__name__)), module)


def remember_blocks(gm, source):
    """Record in `gm.meta["kvwire_blocks"]` the dotted names of the `Block`s that `gm`'s calls are
    or sit in. fx rebuilds the containers of the modules a graph calls as plain `nn.Module`s, so a
    graph traced at "layer" depth would otherwise no longer know that `layers.3` was a block.
    Returns gm."""
    known = set(getattr(source, "meta", {}).get("kvwire_blocks", ())) if isinstance(source, fx.GraphModule) else set()
    blocks = set()
    for node in layer_calls(gm):
        parts = node.target.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            try:
                held = source.get_submodule(name)
            except AttributeError:  # a module the trace registered on gm only
                break
            if name in known or isinstance(held, Block):
                blocks.add(name)
    gm.meta["kvwire_blocks"] = sorted(blocks)
    return gm


def layer_calls(gm):
    """The call_module nodes of a traced graph, in execution order."""
    return [n for n in gm.graph.nodes if n.op == "call_module"]
