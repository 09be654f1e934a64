"""Linear maps that keep a copy of their weight in the layout the CPU's fastest kernel reads.

`kernels.products` chooses the kernel of each product (`linear`) and the packed copy it reads
(`pack_kind`); `WeightPack` holds that copy for one weight and makes it once enough products want
it. Exporters see plain `linear`; compiled float32 decode steps see `kvwire::packed_linear`, an op
opaque to Inductor that reads the packed copy at run time, where a pack applies to the traced shapes
(else plain `linear`).
"""
import itertools
import weakref

import torch
from torch import nn

from ..kernels.cpu import f32_gemv
from ..kernels.native import gemv
from ..kernels.products import linear, pack_kind
from ..kernels.tracing import is_exporting

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
    # checks a compiled step pays ~127 times. The kernel runs under `torch.compiler.disable`: called
    # from compiled code, dynamo would otherwise trace its frames.
    torch.library.define("kvwire::packed_linear", "(Tensor x, Tensor weight, Tensor? bias, int pack) -> Tensor")
    torch.library.impl("kvwire::packed_linear", "CPU", torch.compiler.disable(_packed_linear))
    torch.library.register_fake("kvwire::packed_linear",
                                lambda x, weight, bias, pack: x.new_empty(*x.shape[:-1], weight.shape[0]))
    # last, once the ops exist: dynamo calls it once per traced product and bakes the answer in (the
    # CPU checks read files, which it cannot trace; `disable` keeps it from tracing that call's frames)
    untraced = torch.compiler.disable(pack_kind)
    _COMPILED["kind"] = torch.compiler.assume_constant_result(lambda role, rows, dtype, no_bias:
                                                              untraced(role, rows, dtype, no_bias))


def _packed_linear(x, weight, bias, pack):
    """x (..., in) @ weight (out, in)^T + bias -> (..., out), read from the packed copy of the
    `WeightPack` whose `ident` is `pack` where it serves (else `linear`)."""
    owner = _PACKS.get(pack)
    out = None if owner is None else owner(x, weight, bias)
    return nn.functional.linear(x, weight, bias) if out is None else out


class WeightPack:
    """A copy of a weight in the layout the CPU's fastest kernel reads, for the products it pays in
    (`kernels.products.pack_kind` names the kind). `role`: "head" (the language-model head) or
    "projection" (a layer's `Linear`).

    - float32 where `cpu.f32_gemv()` is "transposed" (AMD, AVX2): the head at one row, MKL-packed;
      projections gain nothing from packing there (not copied).
    - float32 where it is "linear" (an Intel CPU with AVX-512), 2 to 64 rows (batched decode): the
      head reads a oneDNN-packed copy, projections MKL-packed copies made for that row count. One row
      stays on `linear` or kvwire's GEMV: one pack a weight means batch-1 and batch-4 calls in turn
      would each reset the other's count, and neither would ever be packed.
    - bfloat16, the head at one row where `cpu.f32_row()` is "kvwire": no copy, kvwire's GEMV.
    - bfloat16, up to `PACKED_BF16_ROWS` rows, where `cpu.bf16_gemm()` is "packed" (a CPU with bf16
      units): oneDNN's blocked layout, the same values as `linear` on the dense input bit for bit at
      few rows (at 512 rows blocking changes the summation order: log-probs within 0.005). Unpacked,
      oneDNN re-lays the weight out on every call.

    Any way the copy is a second one in memory (the weight's size: 671 MB for the default model's
    float32 head), made once `after` products have read the same weight so short runs (`kvwire
    generate`, a first token) skip it, rebuilt when the weight changes (in-place edits of the
    parameter bump its version; edits through `.data` do not: call `lm.reset_caches()` after them)
    or when `after` products of one other row count come in a row to an MKL pack, and freed by
    `lm.reset_caches()` (`clear`). docs/kernels.md gives the measurements behind each case.

    Call `pack(x, weight, bias=None)`: the product (..., out), or None where it does not apply (other
    dtypes or row counts, autograd, exporters, no MKL / oneDNN, not yet `after` calls); the caller
    falls back to `linear`. Inside a graph being compiled the call is `in_graph`: a float32 decode
    step's product as a `kvwire::packed_linear` op that runs this same call when the compiled code
    runs.
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
        return pack_kind(self.role, x.numel() // x.shape[-1], x.dtype, bias is None)

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
        # One row (kvwire's GEMV): only the head's product goes through the op (at run time this
        # pack's `__call__`, which calls the GEMV); projections stay Inductor's own, which served a
        # served process's decode faster than ~127 calls a step through Python. bfloat16: only the
        # head's one row, where Inductor's own bf16 products pay no call through Python at all.
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
