"""`GGMLLinear`: a linear map whose weight stays in a GGUF block format (Q8_0, Q5_0, Q4_K, ...).

The weights a GGUF file ships are used as they are, with no re-quantisation and so no further
loss: ggml's own kernels run on the blocks (`kvwire.kernels.ggml`), with activations quantised per
row to ggml's partner format (8-bit) as llama.cpp does. One or two rows (decode; up to seven for a
vocabulary-sized head and for Q4_1 / Q5_1) run a dot product per weight row; more rows run ggml's
own matrix product, tiled as llama.cpp's is (`matmul.c`'s `kvw_matmuls` chooses). The formats ggml
has no tiled kernel for (Q4_1, Q5_1) instead dequantise the weight and use MKL's float32 GEMM
beyond `MANY_ROWS` rows, which wins there.

On CPUs with AVX-512 (F, BW, VL) and VNNI, Q4_1, Q5_0, Q8_0 and Q4_K blocks are repacked at
construction into `x16.c`'s layout (same bytes, 16 rows interleaved) and run kvwire's own kernel at
every row count, faster than ggml's at most shapes; on CPUs with AVX2 only, Q4_1, Q8_0, Q4_K and
Q6_K blocks are. `kernels.cpu.ggml_kernel()` chooses, `KVWIRE_GGML_KERNEL=ggml|x16` overrides.
bench/ggml_matmul.py measures the crossovers; docs/kernels.md gives the numbers. Eager, a layer's
sibling projections run as one call (`kernels.products.siblings`).
"""
import torch
from gguf import GGMLQuantizationType
from torch import nn

from ...kernels.cpu import ggml_kernel
from ...kernels.ggml import lib as bridge
from ...kernels.ggml.lib import library

# Formats whose matrix product ggml runs row by row (no tiled kernel): above MANY_ROWS rows,
# dequantising + float32 GEMM beats them; every other format stays on ggml's kernels at any size
UNTILED = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1)
MANY_ROWS = 32
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# the formats x16.c repacks, and the type numbers matmul.c knows their repacked blocks by
X16 = {GGMLQuantizationType.Q4_1: 1001, GGMLQuantizationType.Q5_0: 1002, GGMLQuantizationType.Q8_0: 1003,
       GGMLQuantizationType.Q4_K: 1004, GGMLQuantizationType.Q6_K: 1005}
REPACK_ROWS = 16384  # rows repacked at a time (a multiple of x16's 16-row groups)
QUANTIZE_ROWS = 4096  # rows quantised at a time (a multiple of 16): a float chunk of 10 MB for a 640-wide head
# what `GGMLLinear.quantize` makes: ggml's quantiser handles these without an importance matrix
QUANTIZE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")


class GGMLLinear(nn.Module):
    """y = x @ W^T + b with W (out, in) held as ggml blocks.

    Args:
        blocks: (out, row_bytes) uint8, each row `in_features` weights in `qtype` blocks.
        qtype: a `gguf.GGMLQuantizationType` (or its id) with a ggml CPU dot product.
        in_features: weights per row. bias: (out,) or None.
        kernel: for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K, "x16" (repack the blocks for kvwire's kernel where it runs the format)
            or "ggml"; None: `ggml_kernel()`'s choice for this CPU. `blocks` is always ggml's layout.
        release: called as release(start, stop) once rows start..stop of `blocks` are repacked (a
            loader gives a memory-mapped file's pages back there); None: nothing is called.

    Shapes: x (..., in) -> (..., out), in x's dtype (computed in float32).

    Example:
        >>> q = GGMLLinear.quantize(torch.randn(64, 256), "q4_k")
        >>> q(torch.randn(2, 256)).shape
        torch.Size([2, 64])
    """

    cpu_only = "ggml blocks (ggml's CPU kernels)"  # what runs it, where a move to another device is refused
    exportable = False  # no export runtime has ggml's block kernels

    def __init__(self, blocks, qtype, in_features, bias=None, kernel=None, release=None):
        super().__init__()
        lib = library()
        self.qtype = GGMLQuantizationType(int(qtype))
        if self.qtype in FLOAT_TYPES or not lib.kvw_supported(int(self.qtype)):
            raise ValueError(f"ggml has no CPU dot product for {self.qtype.name} weights")
        _check_width(self.qtype, in_features)
        row_bytes = lib.kvw_row_bytes(int(self.qtype), in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"expected blocks of shape (out, {row_bytes}) uint8 for {in_features} "
                             f"{self.qtype.name} weights a row; got {tuple(blocks.shape)} {blocks.dtype}")
        self.in_features, self.out_features = in_features, blocks.shape[0]
        # the type number the kernels are called with: qtype's own, or X16's for repacked blocks
        self.kernel_type = int(self.qtype)
        if x16_layout(self.qtype, kernel):
            blocks, self.kernel_type = _repacked(blocks, self.qtype, in_features, True, release), X16[self.qtype]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def __setstate__(self, state):  # unpickled (torch.load, deepcopy): register the kernels first
        state.setdefault("kernel_type", int(state["qtype"]))  # pickled before x16 existed: ggml's layout
        super().__setstate__(state)
        library()
        if self.repacked and not x16_layout(self.qtype):  # pickled where the x16 kernel runs
            self.blocks = _repacked(self.blocks, self.qtype, self.in_features, to_x16=False)
            self.kernel_type = int(self.qtype)

    @classmethod
    def quantize(cls, weight, qtype, bias=None, kernel=None):
        """Quantise a float (out, in) weight with ggml's own quantiser ("q8_0", "q4_k", ...)."""
        out_features, in_features = weight.shape
        return cls._quantized(lambda start, stop: weight.detach()[start:stop].float().contiguous(),
                              qtype, out_features, in_features, bias, kernel)

    def requantize(self, qtype):
        """These weights in another ggml format, read from the blocks a chunk of rows at a time: a
        tied head re-quantised from a GGUF's own blocks never touches the float embedding table
        (671 MB for Gemma 3's 262k rows), only these blocks (178 MB as Q8_0)."""
        bias = None if self.bias is None else self.bias.detach()
        return self._quantized(self._dequantized, qtype, self.out_features, self.in_features, bias)

    @classmethod
    def _quantized(cls, rows_of, qtype, out_features, in_features, bias, kernel=None):
        """A GGMLLinear of `qtype` blocks quantised from rows_of(start, stop) -> (stop - start, in)
        float32, QUANTIZE_ROWS rows at a time (a float32 copy of a 262k-row head would be 671 MB), each
        chunk repacked for x16 as it is made (the whole weight is never held in both layouts)."""
        qtype = qtype_of(qtype)
        if qtype.name not in QUANTIZE_TYPES:
            raise ValueError(f"kvwire quantises to {', '.join(t.lower() for t in QUANTIZE_TYPES)}; "
                             f"got {qtype.name.lower()}")
        lib = library()
        _check_width(qtype, in_features)  # before ggml's quantiser, which would abort on it
        x16 = x16_layout(qtype, kernel)
        row_bytes = lib.kvw_row_bytes(int(qtype), in_features)
        blocks = torch.empty(out_features, row_bytes, dtype=torch.uint8)
        chunk = torch.empty(min(QUANTIZE_ROWS, out_features), row_bytes, dtype=torch.uint8) if x16 else None
        for start in range(0, out_features, QUANTIZE_ROWS):
            part = rows_of(start, min(start + QUANTIZE_ROWS, out_features))
            into = chunk if x16 else blocks[start:]
            lib.kvw_quantize(int(qtype), part.data_ptr(), into.data_ptr(), part.shape[0], in_features)
            if x16:  # QUANTIZE_ROWS is a multiple of x16's 16-row groups
                lib.kvw_x16_repack_rows(int(qtype), chunk.data_ptr(), blocks[start].data_ptr(), part.shape[0],
                                        in_features, 1, torch.get_num_threads())
        return cls.in_kernel_layout(blocks, qtype, in_features, bias, kernel)

    @classmethod
    def in_kernel_layout(cls, blocks, qtype, in_features, bias=None, kernel=None):
        """A GGMLLinear on `blocks` already in the layout its kernel reads (x16's where
        `ggml_kernel(kernel)` is "x16" for the type, else ggml's), taken as they are: no repacking."""
        qtype = qtype_of(qtype)
        module = cls(blocks, qtype, in_features, bias, kernel="ggml")
        if x16_layout(qtype, kernel):
            module.kernel_type = X16[qtype]
        return module

    def forward(self, x):
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).float().contiguous()
        if self.ggml_operands(rows) is None:
            out = nn.functional.linear(x2, self.dequantize())
        else:  # op.cpp's kernel; an opaque op to torch.compile
            out = torch.ops.kvwire.ggml_matmul(x2, self.blocks, self.kernel_type, self.in_features)
        return self.finish(out, x)

    def ggml_operands(self, rows):
        """(blocks, kernel type) where a call on `rows` rows is one `kvwire::ggml_matmul` (then
        `finish`), None where it dequantises instead (`kernels.products.siblings` fuses the former)."""
        # compiled graphs keep the opaque op: dequantising calls ctypes, where dynamo would break the graph;
        # x16 beats dequantising at every row count
        if not torch.compiler.is_compiling() and rows > MANY_ROWS and self.qtype in UNTILED and \
                not self.repacked:
            return None
        return self.blocks, self.kernel_type

    def finish(self, out, x):
        """The product `out` (rows, out_features) float32 of input `x` (..., in_features) as forward
        returns it: bias added, in x's dtype and leading shape."""
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    # a state dict holds ggml's layout, whichever layout this CPU runs: it loads anywhere
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "blocks"] = self.ggml_blocks()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "blocks"
        given = state_dict.get(key)
        if self.repacked and isinstance(given, torch.Tensor) and given.shape == self.blocks.shape and \
                given.dtype == torch.uint8:
            state_dict = {**state_dict, key: _repacked(given, self.qtype, self.in_features, to_x16=True)}
        super()._load_from_state_dict(state_dict, prefix, *args)

    def ggml_blocks(self):
        """The blocks in ggml's own layout (as a GGUF file holds them): (out, row_bytes) uint8."""
        return _repacked(self.blocks, self.qtype, self.in_features, to_x16=False) if self.repacked else self.blocks

    @property
    def repacked(self):
        """Whether the blocks are in x16.c's layout (run by kvwire's kernel), not ggml's."""
        return self.kernel_type != int(self.qtype)

    def rows(self, ids):
        """Rows `ids` of the weight, dequantised (only those): ids (...) integers -> (..., in) float32.
        What a token embedding on this table looks up (`TokenEmbedding.quantized`); an id outside
        0..out-1 raises IndexError.

        Example:
            >>> q = GGMLLinear.quantize(torch.randn(300, 64), "q8_0")
            >>> torch.equal(q.rows(torch.tensor([[7, 2]]))[0], q.dequantize()[[7, 2]])
            True
        """
        return torch.ops.kvwire.ggml_rows(ids, self.blocks, self.kernel_type, self.in_features)

    def dequantize(self):
        """The weight as the kernels see it: (out, in) float32."""
        return self._dequantized(0, self.out_features)

    def _dequantized(self, start, stop):
        """Rows start..stop (start a multiple of 16: a repacked group's first row) as float32."""
        part = torch.empty(stop - start, self.in_features)
        rc = library().kvw_dequantize(self.kernel_type, self.blocks[start].data_ptr(), stop - start,
                                      self.in_features, part.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError(f"no memory to unpack {stop - start} {self.qtype.name} rows")
        return part

    def extra_repr(self):
        layout = ", repacked for x16" if self.repacked else ""
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype.name}{layout}"


def x16_layout(qtype, kernel=None):
    """Whether `qtype` blocks are kept in x16.c's layout under `ggml_kernel(kernel)`: a format x16 has,
    on a CPU that runs x16 for it (AVX2 runs it for Q4_1, Q8_0, Q4_K and Q6_K only)."""
    qtype = qtype_of(qtype)
    return qtype in X16 and ggml_kernel(kernel) == "x16" and bridge.x16_runs(int(qtype))


def _repacked(blocks, qtype, in_features, to_x16, release=None):
    """`qtype` blocks (out, row_bytes) uint8 moved to x16.c's layout (`to_x16`) or back: a new tensor.
    `release(start, stop)`, when given, is called after each chunk of rows is copied (a loader gives a
    memory-mapped file's pages back there, so a 178 MB head never sits in memory twice)."""
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    for start in range(0, blocks.shape[0], REPACK_ROWS):
        stop = min(start + REPACK_ROWS, blocks.shape[0])
        library().kvw_x16_repack_rows(int(qtype), blocks[start].data_ptr(), out[start].data_ptr(), stop - start,
                                      in_features, int(to_x16), torch.get_num_threads())
        if release is not None:
            release(start, stop)
    return out


def _check_width(qtype, in_features):
    block = library().kvw_block_size(int(qtype))
    if in_features % block:
        raise ValueError(f"{qtype.name} packs {block} weights a block; a weight with {in_features} inputs "
                         f"is not a multiple of {block}")


def qtype_of(name):
    """A `GGMLQuantizationType` from "q4_k" / "Q4_K" / a type / its id, or a ValueError."""
    if isinstance(name, str):
        try:
            return GGMLQuantizationType[name.upper()]
        except KeyError:
            raise ValueError(f"unknown ggml type {name!r}; expected e.g. 'q8_0', 'q5_0', 'q4_k', 'q6_k'") from None
    return GGMLQuantizationType(int(name))
