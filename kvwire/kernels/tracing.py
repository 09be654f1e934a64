"""Which tracer or transform runs a layer's forward, across the torch versions kvwire accepts (torch>=2.6)."""
import torch


def is_exporting():
    """`torch.compiler.is_exporting()`, which torch 2.6 lacks: there False (its exports still read
    `torch.compiler.is_compiling()` as True, which the layers check first or alongside).

    Example:
        >>> is_exporting()
        False
    """
    check = getattr(torch.compiler, "is_exporting", None)
    return bool(check()) if check is not None else False


def transformed(*tensors):
    """Whether forward-mode AD is on or a functorch transform (vmap, grad, jvp) wraps any of `tensors`:
    kernels that read data pointers must leave such calls to PyTorch's ops (a wrapped tensor has no
    storage; a dual tensor's tangent would be dropped).

    Example:
        >>> transformed(torch.ones(2))
        False
    """
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return True
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return wrapped is not None and any(wrapped(t) for t in tensors)
