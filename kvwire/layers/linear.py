"""Linear maps with a CPU kernel choice that matters for decoding.

For a few rows (decode: batch x 1 token) where `cpu.f32_gemv()` is "transposed" (not an Intel CPU
with AVX-512), MKL's float32 GEMM is far faster on W @ x^T than on the x @ W^T that
`nn.functional.linear` runs: measured on an AMD CPU, the 262144 x 640 head at 4 rows took
69 ms against 272 ms, a 2048 x 640 projection at 1 row 0.2 ms against 0.44 ms. With weights
streamed from memory (as in a real model), a wide weight (out > in) is read about 1.6x faster for
an even number of rows than for one or three, and a square one about 1.5x (bench/gemv.py on an
AVX2 CPU: 576 x 576 in 0.154 against 0.236 ms), so odd row counts get one repeated row there; a
narrow one (out < in, a down projection) reads slower so (640 x 2048: 0.58 against 0.44 ms).
Many rows (prefill) keep `linear`, which is slightly faster there. On Intel CPUs with AVX-512
("linear") MKL's own kernels make `linear` faster than W @ x^T at every row count (and the repeated
row twice as slow), so products go there, but batched decode (2-64 rows) reads packed copies
(`WeightPack`: `linear` runs 4-8 rows at a fraction of memory speed). Exporters see plain `linear`;
compiled float32 decode steps see `kvwire::packed_linear`, an op opaque to Inductor that reads the
packed copy at run time, where a pack applies to the traced shapes (else plain `linear`).

Reduced-precision weights stream half the bytes in decode (bf16 GEMV: 36 ms against 102 ms for the
head), but bf16 GEMM with many rows is slow on CPUs without native bf16 (512 x 640 x 2048: 86 ms
against 15 ms in float32), so there many rows are computed in float32 from upcast weights; CPUs
with bf16 units (AVX512_BF16, AMX) keep them in bf16 (`cpu.bf16_gemm`).
"""
import itertools
import weakref

import torch
from torch import nn

from ..native import gemv
from .cpu import bf16_gemm, f32_gemv, f32_row
from .tracing import is_exporting

SMALL_ROWS = 64
# bf16 products read oneDNN-packed weights up to this many rows; from ~384 rows oneDNN's own per-call
# path is faster (AMX Xeon, a default-model layer's five products: 3.86 against 4.13 ms packed at 320
# rows, 4.86 against 3.80 ms at 384; a 640 x 2048 down projection at 512 rows 1.67 against 1.05 ms)
PACKED_BF16_ROWS = 256
_UPCAST = (torch.bfloat16, torch.float16)


def linear(x, weight, bias=None):
    """x (..., in) @ weight (out, in)^T + bias -> (..., out)."""
    rows = x.numel() // x.shape[-1]
    if torch.compiler.is_compiling():
        return nn.functional.linear(x, weight, bias)
    if rows == 1 and x.dtype == torch.float32 and f32_row() == "kvwire" and gemv.applies(x, weight, bias):
        return gemv.product(x, weight, bias)  # batch-1 decode: kvwire's GEMV streams weights faster
    # bf16 GEMM costs about rows x GEMV here: from 8 rows, upcasting a (small) weight is cheaper
    upcast = rows > SMALL_ROWS or (rows > 4 and weight.numel() < 1 << 24)
    if upcast and x.dtype in _UPCAST and x.device.type == "cpu" and not (x.dtype == torch.bfloat16
                                                                        and bf16_gemm() != "upcast"):
        b = None if bias is None else bias.float()
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
    if rows > SMALL_ROWS or x.dtype != torch.float32 or f32_gemv() == "linear":
        return nn.functional.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows % 2 and weight.shape[0] >= weight.shape[1]:
        # one or three rows stream a wide weight at ~6.5 GB/s, two or four at ~10-11, and a square
        # one 1.5x faster so too (bench/gemv.py): repeat the last row and drop its result
        x2 = torch.cat((x2, x2[-1:]))
    out = (weight @ x2.t()).t()[:rows]  # (rows, out)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _kind_for(role, rows, dtype, no_bias):
    """The packed kernel ("mkl", "onednn") a product of `rows` rows in `dtype` takes, or None: the
    shape and dtype part of `WeightPack.kind`."""
    if dtype == torch.bfloat16:
        if rows == 1 and role == "head" and f32_row() == "kvwire":
            return "row"  # kvwire's GEMV reads the head in place: no packed copy, faster (native/gemv.c)
        return "onednn" if bf16_gemm() == "packed" and rows <= PACKED_BF16_ROWS else None
    if dtype != torch.float32:
        return None
    if rows == 1 and f32_row() == "kvwire":
        return "row"  # kvwire's GEMV, on the weight itself (no copy)
    head = role == "head"
    # torch builds MKL's packed ops only alongside oneDNN: both are checked for them
    mkl = torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
    if f32_gemv() == "transposed":
        return "mkl" if head and rows == 1 and no_bias and mkl else None
    if not 2 <= rows <= SMALL_ROWS:
        return None
    if head:
        return "onednn" if no_bias and torch.backends.mkldnn.is_available() else None
    return "mkl" if mkl else None


_NO_EXPORT_CHECK = getattr(torch.compiler, "is_exporting", None) is None  # torch 2.6: exports look compiled
_PACKS = weakref.WeakValueDictionary()  # WeightPack.ident -> WeightPack, for compiled graphs
_IDENTS = itertools.count()
_COMPILED = {}  # filled by `allow_packs_in_compiled_graphs`: "kind" (a constant to dynamo)


def allow_packs_in_compiled_graphs():
    """Register `kvwire::packed_linear` and what `WeightPack.in_graph` needs, once;
    `lm.compile()`'s first step calls it (it imports dynamo, ~1.5 s, which importing kvwire does not).
    Graphs traced before it (a plain `torch.compile` of a model) keep plain `linear`."""
    if _COMPILED:
        return
    # Registered on the dispatcher directly, not through `torch.library.custom_op`, whose per-call
    # checks a compiled step pays ~127 times: paired, compiled batch-4 decode 80.88 -> 82.50 tokens/s
    # (session 26). The kernel runs under `torch.compiler.disable`: called from compiled code, dynamo
    # would otherwise trace its frames.
    torch.library.define("kvwire::packed_linear", "(Tensor x, Tensor weight, Tensor? bias, int pack) -> Tensor")
    torch.library.impl("kvwire::packed_linear", "CPU", torch.compiler.disable(_packed_linear))
    torch.library.register_fake("kvwire::packed_linear",
                                lambda x, weight, bias, pack: x.new_empty(*x.shape[:-1], weight.shape[0]))
    # last, once the ops exist: dynamo calls it once per traced product and bakes the answer in (the
    # CPU checks read files, which it cannot trace; `disable` keeps it from tracing that call's frames)
    untraced = torch.compiler.disable(_kind_for)
    _COMPILED["kind"] = torch.compiler.assume_constant_result(lambda role, rows, dtype, no_bias:
                                                              untraced(role, rows, dtype, no_bias))


def _packed_linear(x, weight, bias, pack):
    """x (..., in) @ weight (out, in)^T + bias -> (..., out), read from the packed copy of the
    `WeightPack` whose `ident` is `pack` where it serves (else `linear`)."""
    owner = _PACKS.get(pack)
    out = None if owner is None else owner(x, weight, bias)
    return nn.functional.linear(x, weight, bias) if out is None else out


class WeightPack:
    """A copy of a weight in the layout the CPU's fastest kernel reads, for the products it pays in.
    `role`: "head" (the language-model head) or "projection" (a layer's `Linear`).

    - float32, by `cpu.f32_gemv()`:
      "transposed" (AMD, AVX2), the head at one row (batch-1 decode): MKL-packed. The default
      model's 262144 x 640 head in 43-49 ms instead of 54-58 ms with the repeated row or 74-77 ms
      with `linear` (two runs of bench/gemv.py, AMD); batch-1 decode 10.2 against 8.8 tokens/s
      unpacked (best of 4, interleaved). Packing that head takes about 1.5 s. Projections gain
      nothing from packing there (not copied).
      "linear" (an Intel CPU with AVX-512), 2 to 64 rows (batched decode): MKL's `linear` runs 4 or
      8 rows at a fraction of memory speed (the head: 80 / 127 ms against 29 ms for one row). The
      head reads a oneDNN-packed copy (39 / 42 ms; packed in 0.3 s where MKL's pack takes 1.5 s
      and reads no faster), projections MKL-packed copies made for that row count (per call
      cheaper than oneDNN's: batch-4 decode 43-45 against 40-42 tokens/s with oneDNN's, 38-42
      with none, same process; all 126 of the default model packed in ~0.15 s). One row stays on
      `linear`: session 23 (memory at ~15 GB/s) measured nothing from MKL's one-row pack of the
      head; session 25 (~30 GB/s) 1.056x eager and 1.073x compiled batch-1 decode (paired rounds),
      but one pack a weight means batch-1 and batch-4 calls in turn (bench/generate.py's rounds)
      each reset the other's count and neither is ever packed (batch-4 decode 67 -> 47 tokens/s).
    - bfloat16, the head at one row where `cpu.f32_row()` is "kvwire": no copy, kvwire's GEMV
      (`native.gemv`, faster than the packed copy: 13.3-14.4 against 16.5 ms for the default model's).
    - bfloat16, up to `PACKED_BF16_ROWS` (256) rows, where `cpu.bf16_gemm()` is "packed" (a CPU with
      bf16 units): oneDNN's blocked layout, the same values as `linear` on the dense input bit for
      bit at few rows (at 512 rows blocking changes the summation order: log-probs within 0.005).
      Unpacked, oneDNN re-lays the weight out on every call: at one row a 2048 x 640 projection took
      0.079 against 0.039 ms packed, the head 19.0 against 12.9 ms (memory speed); 0.249 against
      0.206 ms at 32 rows; from ~384 rows the unpacked call is the faster one.

    Any way the copy is a second one in memory (the weight's size: 671 MB for the float32 head,
    401 MB for the default model's float32 projections, 335 MB for its bf16 head), made once
    `after` products have read the same weight so short runs (`kvwire generate`, a first token) skip
    it, rebuilt when the weight changes (in-place edits of the parameter bump its version; edits
    through `.data` do not: call `lm.reset_caches()` after them) or when `after` products of one
    other row count come in a row to an MKL pack, and freed by `lm.reset_caches()` (`clear`).

    Call `pack(x, weight, bias=None)`: the product (..., out), or None where it does not apply (other
    dtypes or row counts, autograd, exporters, no MKL / oneDNN, not yet `after` calls); the caller
    falls back to `linear`. Inside a graph being compiled the call is `in_graph`: a float32 decode
    step's product as a `kvwire::packed_linear` op that runs this same call when the compiled code
    runs (compiled float32 batch-4 decode 49 -> 77 tokens/s, paired, session 25).
    """

    def __init__(self, after=64, role="head"):
        if role not in ("head", "projection"):
            raise ValueError(f"WeightPack role={role!r}; expected 'head' or 'projection'")
        self.key = self.packed = self.rows = None
        self.after, self.role = after, role
        self.calls = (None, 0)  # (weight key, products seen with it)
        self.misses = (None, 0)  # (row count, products in a row with it) other than an MKL pack's
        self.ident = next(_IDENTS)  # how compiled graphs name it (`packed_linear`)
        _PACKS[self.ident] = self

    def kind(self, x, weight, bias):
        """"mkl", "onednn" or None: the packed kernel this product can take."""
        if torch.compiler.is_compiling() or is_exporting():  # first: compilers cannot trace the rest
            return None
        if (x.device.type != "cpu" or type(x) is not torch.Tensor or x.dtype != weight.dtype
                or (bias is not None and bias.dtype != x.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                 or (bias is not None and bias.requires_grad)))):
            return None
        return _kind_for(self.role, x.numel() // x.shape[-1], x.dtype, bias is None)

    def in_graph(self, x, weight, bias=None):
        """The product inside a graph being compiled: `kvwire::packed_linear` (opaque to the compiler;
        at run time it is this pack's `__call__`, with `linear` where no copy serves) where these
        static shapes would take a pack, else None (the caller traces `linear`). Only float32 inputs
        of one position a row, (B, D) or (B, 1, D), take it (decode steps, a step's head), and a bfloat16
        head's one row where kvwire's GEMV reads it; exports, grad mode, a compiled prompt's chunk (its
        length is dynamic) and torch without `is_exporting` get None."""
        kind = _COMPILED.get("kind")
        if (kind is None or not torch.compiler.is_compiling() or _NO_EXPORT_CHECK or is_exporting()
                or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16)
                or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)):
            return None
        # one position a row (decode steps; a step's head): rows is the batch, static; a compiled
        # prompt's length is dynamic, and dynamo bakes in no answer for a symbolic row count
        if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] != 1):
            return None
        found = kind(self.role, x.shape[0], x.dtype, bias is None)
        # One row (kvwire's GEMV, `native.gemv`): only the head's product goes through the op (at run time
        # this pack's `__call__`, which calls the GEMV); projections stay Inductor's own. Every one-row
        # product through an op gave 24.9-26.3 against 23.9-24.3 tokens/s in scripts, but 18.7-20.6
        # against 23.2 in the bench's served process (batch-1 decode, session 27; py-spy put the
        # difference on the Python lines around the kernel, ~127 calls a step: not understood); the head
        # is one call a step and a third of its bytes.
        # bfloat16: only the head's one row (kvwire's GEMV). Compiled bf16 batch-1 decode ran 0.90x with
        # its 127 products through the op (oneDNN's packs; paired, session 25), where Inductor's own bf16
        # products pay no call through Python; the head's alone, 23.32 / 24.49 -> 30.81 / 31.35 tokens/s
        # (`--variants bfloat16+compile`'s model in a script, alternated, session 29).
        if found is None or (found == "row" and self.role != "head") or (
                x.dtype == torch.bfloat16 and found != "row"):
            return None
        return torch.ops.kvwire.packed_linear(x, weight, bias, self.ident)

    def __call__(self, x, weight, bias=None):
        if torch.compiler.is_compiling():
            return self.in_graph(x, weight, bias)
        kind = self.kind(x, weight, bias)
        if kind is None:
            return None
        if kind == "row":
            return gemv.product(x, weight, bias) if gemv.applies(x, weight, bias) else None
        rows = x.numel() // x.shape[-1]
        key = (kind, weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self.key:
            self.packed, self.key = None, None  # a stale copy (the weight changed) goes at once
            seen, count = self.calls
            count = count + 1 if seen == key else 1
            self.calls = (key, count)
            if count < self.after:
                return None
            self._pack(kind, weight, rows)
            self.key = key
        elif kind == "mkl" and rows != self.rows:
            # an MKL pack serves the row count it was made for (decode's, which most products have);
            # others (a prompt's chunk) take `linear`, unless `after` products of one new count come
            # in a row (a new batch size)
            seen, count = self.misses
            self.misses = (rows, count + 1 if seen == rows else 1)
            if self.misses[1] < self.after:
                return None
            self._pack(kind, weight, rows)
        else:
            self.misses = (None, 0)
        if kind == "onednn":  # oneDNN reads x as dense: a strided view gives wrong values, not an error
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [None], "")
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), self.packed, weight, bias, rows)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _pack(self, kind, weight, rows):
        self.packed = None  # the old copy goes before the new one is made
        w = weight.detach()
        self.packed = (torch.ops.mkl._mkl_reorder_linear_weight(w, rows) if kind == "mkl"
                       else torch.ops.mkldnn._reorder_linear_weight(w, None))
        self.rows, self.misses = rows, (None, 0)

    def clear(self):
        self.key = self.packed = self.rows = None
        self.calls, self.misses = (None, 0), (None, 0)

    def __deepcopy__(self, memo):  # a copied model packs its own weight when it needs to
        return WeightPack(self.after, self.role)

    def __getstate__(self):  # pickled empty: a packed tensor has no storage to save
        return {"after": self.after, "role": self.role}

    def __setstate__(self, state):  # pickles before `role` said float32=False for a projection's
        self.__init__(state["after"], state.get("role", "head" if state.get("float32", True) else "projection"))


def clear_packs(module):
    """Free every `WeightPack` copy under `module` (they are made again when needed)."""
    for m in module.modules():
        pack = getattr(m, "pack", None)
        if isinstance(pack, WeightPack):
            pack.clear()


class Linear(nn.Linear):
    """`nn.Linear` computed with `linear` above, or on a packed copy of its weight (`WeightPack`:
    bfloat16 where the CPU has bf16 units, float32 batched decode on an Intel CPU with AVX-512);
    same parameters, same results (to float32 rounding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack = WeightPack(role="projection")

    def forward(self, x):
        # float32 packs only on the "linear" path, and never one row (batch-1 decode): the rest skip
        # the pack's checks, ~2 us a call; compilers first: they take `WeightPack.in_graph` (and would
        # break the graph at `f32_gemv`)
        packable = torch.compiler.is_compiling() or x.dtype == torch.bfloat16 or (
            x.dtype == torch.float32 and x.numel() != x.shape[-1] and f32_gemv() == "linear")
        out = self.pack(x, self.weight, self.bias) if packable else None
        return linear(x, self.weight, self.bias) if out is None else out
