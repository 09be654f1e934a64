"""Weight dtypes kvwire accepts, by torch dtype or by name, in one place for every entry point."""
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
