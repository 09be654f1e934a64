"""Weight dtypes and devices kvwire accepts, by torch object or by name, in one place for every entry point."""
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weights_dtype(dtype):
    """A torch dtype from a dtype or its name ("bfloat16"); anything else is refused.

    Example:
        >>> weights_dtype("bfloat16")
        torch.bfloat16
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")
    return dtype


def weights_device(device):
    """A torch.device from a device, its name ("cuda:0") or a CUDA index, checked to be usable in
    this process (an allocation is tried); anything else is refused with the reason.

    Example:
        >>> weights_device("cpu")
        device(type='cpu')
    """
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device or its name ('cpu', 'cuda:0'), got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}; expected a torch device such as 'cpu', 'cuda' or 'cuda:1' "
                         f"({e})") from None
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as e:  # e.g. a torch built without CUDA
        raise ValueError(f"device {str(device)!r} is not usable here: {str(e).splitlines()[0]}") from None
    return device
