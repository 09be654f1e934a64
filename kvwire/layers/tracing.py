"""Which tracer runs a layer's forward, across the torch versions kvwire accepts (torch>=2.6)."""
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
