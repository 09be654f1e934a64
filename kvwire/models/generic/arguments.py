"""A decoder layer's call arguments, as the build's probe recorded them: (args after the hidden
states, kwargs), read and replaced by parameter name."""
import inspect


def with_arguments(block, args, kwargs, given):
    """The layer's recorded call (args after the hidden states, kwargs) with the arguments `given`
    ({name: value}) in place of the recorded ones, positional where the model passed them so."""
    names = list(inspect.signature(block.forward).parameters)[1:]  # after the hidden states
    args, kwargs = list(args), dict(kwargs)
    for name, value in given.items():
        at = names.index(name) if name in names else None
        if at is not None and at < len(args):
            args[at] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def takes(block, name, kwargs):
    """Whether the layer takes argument `name`: its recorded call passes it by keyword, or its
    forward's signature names it."""
    if name in kwargs:
        return True
    names = list(inspect.signature(block.forward).parameters)
    return name in names


def by_name(block, args, kwargs):
    """{name: value} of a layer's call (args after the hidden states, kwargs)."""
    names = list(inspect.signature(block.forward).parameters)[1:]
    return {**dict(zip(names, args)), **kwargs}
