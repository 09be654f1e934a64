"""Every `KVWIRE_*` environment variable kvwire reads, declared once, and the one function that reads them.

A switch either picks among named kernel paths (`choices`; unset: kvwire chooses for this CPU) or
names something free-form (a folder). `get(name)` reads one, validates it and raises a ValueError
naming the variable, what it holds and what it may hold. docs/kernels.md lists the same table;
`kvwire info` shows each switch's value and default.

Example:
    >>> get("KVWIRE_FUSED") in (None, "kvwire", "aten")
    True
"""
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Switch:
    """name: the variable. choices: the values it takes (lower case; None: free-form). default: what
    applies while it is unset. chooses: what it decides. doc: one line on each value. secret: never
    shown (`current()` and `kvwire info` say only whether it is set)."""
    name: str
    choices: tuple | None
    default: str
    chooses: str
    doc: str
    secret: bool = False


CHOSEN = "chosen for this CPU"
TABLE = {s.name: s for s in (
    Switch("KVWIRE_BF16_GEMM", ("packed", "native", "upcast"), CHOSEN, "bfloat16 products of many rows",
           "packed: oneDNN's blocked copy of each weight; native: bf16 on the weights as they are; "
           "upcast: computed in float32 (the default without bf16 units)"),
    Switch("KVWIRE_F32_GEMV", ("linear", "transposed"), CHOSEN, "float32 products of a few rows (decode)",
           "linear: x @ W^T (Intel CPUs with AVX-512); transposed: W @ x^T (every other CPU)"),
    Switch("KVWIRE_F32_ROW", ("kvwire", "mkl"), CHOSEN, "one-row float32 products and a bfloat16 head's",
           "kvwire: kvwire's AVX-512 GEMV (the default on the `linear` path); mkl: the KVWIRE_F32_GEMV path"),
    Switch("KVWIRE_FUSED", ("kvwire", "aten"), CHOSEN, "a gated MLP's act(gate) * up and RMSNorm",
           "kvwire: one pass on kvwire's AVX-512 kernels (the default with AVX-512F); aten: PyTorch's ops"),
    Switch("KVWIRE_GGML_KERNEL", ("x16", "ggml"), CHOSEN, "the kernel for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K blocks",
           "x16: kvwire's kernel on repacked blocks (the default with AVX-512 VNNI, or AVX2 for Q8_0, Q4_K, Q6_K); ggml: ggml's own"),
    Switch("KVWIRE_CACHE", None, str(Path("~") / ".cache" / "kvwire"), "where converted models and built kernels go",
           "a folder; created when first written"),
    Switch("KVWIRE_THREADS", None, "torch's default (one per core), each step on one fewer per core other "
           "processes keep busy", "the threads of torch's CPU pool in kvwire's commands",
           "a positive int, kept whatever the load; a command's --threads wins over it"),
    Switch("KVWIRE_API_KEYS", None, "none (no key needed)", "keys `kvwire serve` takes besides its --api-key flags",
           "comma-separated keys; kept off the command line, where other users of the machine can read them",
           secret=True),
)}


def get(name):
    """The value of switch `name`: None while unset (or empty), else a free-form switch's value as set
    or a choice in lower case. Raises ValueError for a value outside the switch's choices (or a name
    not in `TABLE`)."""
    switch = TABLE.get(name)
    if switch is None:
        raise ValueError(f"{name} is not one of kvwire's switches; expected one of {', '.join(TABLE)}")
    raw = os.environ.get(name, "")
    if not raw.strip():
        return None
    if switch.choices is None:
        return raw
    value = raw.strip().lower()
    if value not in switch.choices:
        raise ValueError(f"{name}={value!r}; expected one of {', '.join(switch.choices)}")
    return value


def threads():
    """The thread count `KVWIRE_THREADS` asks for, or None while unset."""
    raw = get("KVWIRE_THREADS")
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"KVWIRE_THREADS={raw!r}; expected a positive int (threads of torch's CPU pool)")
    return int(raw)


def cache_root():
    """The folder `KVWIRE_CACHE` names, else ~/.cache/kvwire."""
    return Path(get("KVWIRE_CACHE") or Path.home() / ".cache" / "kvwire")


def current():
    """{name: {"value": as set or None, "default": ..., "choices": [...] or None}} for every switch
    (values unvalidated: `kvwire info` reports a bad one where the path it sets is refused)."""
    return {s.name: {"value": _shown(s), "default": s.default,
                     "choices": None if s.choices is None else list(s.choices)} for s in TABLE.values()}


def _shown(switch):
    value = os.environ.get(switch.name) or None
    return "(hidden)" if switch.secret and value else value
