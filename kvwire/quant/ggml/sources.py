"""Which rows of which GGUF tensor feed each backbone weight, and the weights a model on the file's
blocks still holds as floats, found by running the family's GGUF converter on stand-ins.

Converters may split or reorder whole rows of a tensor (GPT-2 splits the fused q/k/v, llama's Q/K
rows are un-permuted), never mix values within a row: a quantised tensor's rows given as their row
numbers come out where the rows go, with no block dequantised.
"""
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tqdm.auto import tqdm

from .linear import FLOAT_TYPES, GGMLLinear


def quantised(gguf):
    """Indices (into `gguf.infos`) of the 2-D tensors held in a quantised block format."""
    return {i for i, (_, dims, kind, _) in enumerate(gguf.infos) if len(dims) == 2 and kind not in FLOAT_TYPES}


def row_sources(family, gguf, config):
    """{backbone key: (tensor name, row numbers)} for every quantised 2-D tensor of the file."""
    blocks = quantised(gguf)

    def stand_ins():
        for i, (name, dims, kind, _) in enumerate(gguf.infos):
            yield name, _row_numbers(i, dims) if i in blocks else np.broadcast_to(np.float32(0), list(reversed(dims)))
    sources = {}
    for key, value in family.state_from_gguf(stand_ins(), config).items():
        source = _source(gguf, blocks, key, value)
        if source is not None:
            sources[key] = source
    return sources


def float_state(family, gguf, config, progress=True):
    """The backbone tensors converted as a float load converts them, except those that come whole rows
    of a quantised tensor (those can run on the file's blocks; `row_sources` names them): (out, in)
    float32 arrays of the file's float tensors (norms, F16 / F32 tables), no block dequantised.
    None when the converter made anything else of a quantised tensor (changed its values or mixed
    it in): then only a float load of every tensor converts the file right."""
    blocks = quantised(gguf)

    def tensors():
        for i, (name, dims, _, _) in enumerate(tqdm(gguf.infos, desc=f"reading {len(gguf.infos)} tensors",
                                                    disable=not progress, leave=False)):
            yield name, _row_numbers(i, dims) if i in blocks else gguf.tensor(name)
    state = {}
    for key, value in family.state_from_gguf(tensors(), config).items():
        array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if array.dtype == np.int64:  # row numbers: whole rows of one quantised tensor, or a converter we cannot follow
            if _source(gguf, blocks, key, array) is None:
                return None
        elif array.dtype != np.float32:  # float32 values promoted by a quantised tensor's row numbers
            return None
        else:
            state[key] = value
    return state


def dequantized_rows(gguf, source):
    """The float32 (rows, in) weight that `source` (tensor name, row numbers) names, with the values a
    float load reads (the gguf package's dequantisation)."""
    name, rows = source
    values = _dequantized(gguf, name)
    whole = len(rows) == values.shape[0] and np.array_equal(rows, np.arange(len(rows)))
    return values if whole else np.ascontiguousarray(values[rows])


def _dequantized(gguf, name):
    """A quantised tensor as float32 (rows, in): by ggml's threaded C decoder, ~10x the gguf package's
    numpy one, whose values it gives (tests pin that for the common formats; checked here on rows at
    both ends), or by the gguf package where it does not."""
    qtype, blocks = gguf.blocks(name)
    width = next(dims for tensor, dims, _, _ in gguf.infos if tensor == name)[0]

    def reference(part):
        return np.require(dequantize(part, qtype), dtype=np.float32, requirements=["C"])
    try:
        values = GGMLLinear(torch.from_numpy(blocks), qtype, width, kernel="ggml").dequantize().numpy()
    except ValueError:  # a type ggml's bridge has no kernels for
        return reference(blocks)
    ends = np.unique(np.r_[0:min(16, len(values)), max(0, len(values) - 16):len(values)])
    return values if np.array_equal(values[ends], reference(blocks[ends])) else reference(blocks)


# where each block's float16 scales sit (ggml's block structs; its other fields are small integers):
# a block's weights are finite exactly when these are
_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
           "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def non_finite(gguf):
    """The first quantised 2-D tensor of the file with a NaN or infinite weight (a corrupt file), or None:
    the blocks' scales read in place, nothing decoded (other formats: decoded by the gguf package, a
    chunk of rows at a time)."""
    for i in sorted(quantised(gguf)):
        name = gguf.infos[i][0]
        qtype, blocks = gguf.blocks(name)
        offsets = _SCALES.get(qtype.name)
        if offsets is None:
            finite = all(np.isfinite(dequantize(blocks[start:start + 4096], qtype)).all()
                         for start in range(0, len(blocks), 4096))
        else:
            each = blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])
            finite = all(np.isfinite(each[:, at:at + 2].view(np.float16)).all() for at in offsets)
        gguf.forget(blocks)  # read once here: its pages need not stay in this process
        if not finite:
            return name
    return None


def _row_numbers(index, dims):
    """(rows, 1) int64: tensor `index` in the high bits, the row in the low ones."""
    return ((np.int64(index) << 32) + np.arange(dims[-1] if len(dims) > 1 else 1, dtype=np.int64))[:, None]


def _source(gguf, blocks, key, value):
    """(tensor name, row numbers) when `value` is whole rows of one quantised tensor's stand-in, else None
    (a float stand-in's value). Rows of several tensors mixed into one weight raise."""
    value = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if value.dtype != np.int64 or value.ndim != 2 or value.shape[1] != 1:
        return None
    tensors = np.unique(value[:, 0] >> 32)
    if len(tensors) != 1 or tensors[0] not in blocks:
        raise ValueError(f"{gguf.path}: the GGUF converter mixes rows of several tensors into {key!r}")
    return gguf.infos[int(tensors[0])][0], value[:, 0] & 0xFFFFFFFF
