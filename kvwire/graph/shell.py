"""`shell`: a copy of a module tree that shares every tensor, for passes that swap tensors in place.

torch.export's non-strict tracing puts fake tensors into the parameters and buffers of the modules
it traces, for as long as the trace runs, then puts the real ones back. Another thread reading the
model meanwhile (a server lending a steering slot writes its vector into a buffer) gets the fake
one: its write is lost without an error. Tracing a shell swaps the shell's entries; the model's own
modules keep their real tensors throughout.
"""
import types

from torch import nn


def shell(module):
    """A new module tree with `module`'s classes, settings and submodule structure whose
    parameters, buffers and tensor attributes are the very tensors of `module` (no copy of any
    data): what runs through the shell computes what `module` computes, writes into the same
    storage, and keeps the same names (a program exported from it names its tensors as `module`
    does; a tensor reached only through a module kept as a plain attribute is named by that
    attribute's path, which resolves on `module` too).

    Example:
        >>> twin = shell(lm.backbone)
        >>> twin.layers[0].mlp is lm.backbone.layers[0].mlp     # False: its own module objects
        >>> next(twin.parameters()) is next(lm.backbone.parameters())   # True: the same tensors
    """
    made = {}

    def copy(m):
        if id(m) in made:  # a module registered twice (shared) stays shared in the shell
            return made[id(m)]
        # object.__new__: the same class, not a new one (a GraphModule's __new__ makes a class per
        # instance, and its forward lives on the class)
        twin = made[id(m)] = object.__new__(type(m))
        state = dict(vars(m))
        # the dicts a trace changes are the shell's own; everything else (settings, graph code,
        # plain tensor attributes) is shared by reference
        state["_parameters"], state["_buffers"] = dict(m._parameters), dict(m._buffers)
        state["_modules"] = {name: None if child is None else copy(child) for name, child in m._modules.items()}
        for name, value in state.items():  # every hook table (a trace may register hooks)
            if "hooks" in name and isinstance(value, dict):
                state[name] = type(value)(value)
            elif isinstance(value, types.MethodType) and value.__self__ is m:
                # a method set on the instance (a forward wrapped by a pass) runs on the twin, not on m
                state[name] = types.MethodType(value.__func__, twin)
        object.__setattr__(twin, "__dict__", state)
        return twin

    if not isinstance(module, nn.Module):
        raise TypeError(f"shell() takes an nn.Module, got {type(module).__name__}")
    root = copy(module)
    # modules kept as plain attributes, not submodules (the generic path's handle on the attention
    # inside a block, the transformers model whose embedding it reads) point at shells too: code
    # comparing modules by identity during a trace sees the module it runs. One not in the tree yet is
    # also registered (the attribute still wins lookups), so a trace counts its tensors as the
    # program's own, named by that path, rather than as constants it lifts.
    fixed = 0
    while fixed < len(made):  # copying an attribute's module may add twins with attributes of their own
        twins = list(made.values())[fixed:]
        fixed += len(twins)
        for twin in twins:
            for name, value in list(vars(twin).items()):
                if name != "_modules" and isinstance(value, nn.Module):
                    known = id(value) in made
                    twin.__dict__[name] = copy(value)
                    if not known:
                        twin._modules.setdefault(name, twin.__dict__[name])
    return root
