"""Compiled steps kept on disk: `lm.compile()`'s decode step and short prompt chunks as AOTInductor
packages, built once and loaded by later processes without tracing anything.

`torch.compile` re-traces the model with dynamo in every new process (10-18 s for the default model
with Inductor's on-disk cache warm), so a compiled CLI call paid more than it saved. Here each call
signature (batch, cache length, per-row or shared index, runtime inputs, dtypes; one-token steps
static, prompt chunks of 2 to `prefill_tokens` tokens one graph with the length dynamic) is
exported with `torch.export`, compiled by AOTInductor into a shared library and kept in
`$KVWIRE_CACHE/steps/<digest>/`. The digest (`graph.digest`) covers the code the step runs, the
settings and tensor shapes of every module and kvwire's own sources, plus the torch version and the
CPU; a weight's *values* are not in it: the package holds no weights, the loaded step is handed the
model's own tensors (no copy), so a steered or edited model of the same structure reuses the package
with its own vectors. A later process loads the package with torch's C++ loader alone (no dynamo,
no Inductor import): the first compiled token comes about a second after the model is loaded.

The step writes each chunk into the caches it is given, in place (one slot a decode step), as
`CompiledDecode` does. A package whose recorded key, torch or CPU differ from this process's is
rebuilt; one whose bytes no longer match the digest recorded beside it, or that torch cannot load,
is reported by name (a warning) and rebuilt. Export narrows a prompt chunk graph's length range
where the graph needs it (say to lengths past a ring cache's slots); chunks outside it, and a chunk
graph export cannot make at all, run eager. A decode step export cannot make runs eager with a
warning (`lm.compile(ahead=False)` may still compile it: torch.compile allows graph breaks).
`background=True` moves the compile into a child process while the signature runs eager
(`kvwire.generate.background`): a server keeps answering while a new batch size is built.
"""
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from ..graph.digest import module_digest
from ..graph.shell import shell
from ..kernels.products import compiled_steps
from ..kernels.switches import cache_root
from ..layers.shared import per_call
from .background import Building, check_handed
from .compiled import Buckets, check_settings
from .direct import flat_args, packed
from .keep import file_digest, keep

FORMAT = 1  # bump when what a package holds or how it is called changes
EAGER = "eager"  # a signature whose graph torch.export could not make


class StepProgram(nn.Module):
    """What a package computes: (token_ids (B, T), positions (B, T), cache_index () or (B,),
    attention_mask (B, L), *cache tensors (each layer's pair in order), *runtime inputs (B,)) ->
    logits (B, V) after the chunk's last token, writing the chunk into the cache tensors in place."""

    def __init__(self, cached, head):
        super().__init__()
        self.body, self.head = cached.graph_module, head
        self.pairs = [len(pair) for pair in cached.init_cache(1, 1)]

    def forward(self, token_ids, positions, cache_index, attention_mask, *rest):
        cache, at = [], 0
        for n in self.pairs:
            cache.append(tuple(rest[at:at + n]))
            at += n
        with per_call():
            hidden, _ = self.body(token_ids, positions, cache_index, attention_mask, tuple(cache), *rest[at:])
        return self.head(hidden[:, -1])


class AheadDecode(Buckets):
    """decode(ids (B, T), positions (B, T), cache_index () or (B,), mask (B, L), cache, extra) ->
    (logits (B, V), cache): `CompiledDecode`'s contract, from AOTInductor packages kept in `folder`
    (default `$KVWIRE_CACHE/steps`). The first call of a signature no process has compiled builds
    its package (as long as a `torch.compile` of it); later ones, here or in another process, load it.
    With `background` the build does not hold the caller up past the graph's export (seconds): a
    child process compiles it (`kvwire.generate.background`) while that signature runs eager, and
    the first call after the child is done loads the package.

    Example:
        >>> lm = kw.load("smollm2-135m-instruct", quantize="gguf").compile()   # AheadDecode steps
        >>> lm.generate("Once upon a time", max_new_tokens=64)   # a fresh process: no re-trace
    """

    kept = True  # each shape is built once, ever: an engine may grow its timeline and vary its batch

    def __init__(self, cached, head, bucket=64, prefill_tokens=32, folder=None, background=False):
        check_settings(bucket, prefill_tokens)
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False, got {background!r}")
        self.bucket, self.head, self.prefill_tokens = bucket, head, prefill_tokens
        self.graph = cached.graph_module
        self.program = StepProgram(cached, head).eval()
        self.folder = Path(folder) if folder is not None else kept_folder()
        self.background = background  # compile new packages in a child process; eager meanwhile
        self.runners = {}  # fast_key of a call -> Package, EAGER or Building
        self.built = 0  # packages compiled for this object (the rest were loaded)
        self._key = None

    def takes(self, tokens, max_length):
        """Whether a prompt chunk of `tokens` tokens into caches of `max_length` slots runs here (as
        `CompiledDecode.takes`)."""
        return 1 <= tokens <= self.longest(max_length) and self.length(max_length) == max_length

    def longest(self, max_length):
        """The longest prompt chunk run here: `prefill_tokens`, shorter than the caches (a chunk as
        long as the timeline is a graph torch.export does not make with the others)."""
        return min(self.prefill_tokens, max_length - 1)

    @property
    def key(self):
        """The digest packages are kept under (None: the model's code cannot be read; then packages
        are built for this process only)."""
        if self._key is None:
            digest = module_digest(self.program)
            self._key = "" if digest is None else hashlib.sha256(
                json.dumps([FORMAT, digest, machine()]).encode()).hexdigest()[:32]
        return self._key or None

    def __call__(self, token_ids, positions, cache_index, attention_mask, cache, extra):
        token_ids, positions = packed(token_ids), packed(positions)
        flat = flat_args((token_ids, positions, cache_index, attention_mask, cache, *extra))
        chunk = token_ids.shape[1] > 1
        key = fast_key(flat, chunk)  # a tuple: a JSON signature would cost a step ~4x as much to key
        runner = self.runners.get(key)
        if runner is None:
            runner = self.runners[key] = self._runner(signature(flat, chunk), flat)
        if isinstance(runner, Building) and runner.over():
            runner = self.runners[key] = self._settle(runner)
        if runner is EAGER or isinstance(runner, Building) or \
                not runner.span[0] <= token_ids.shape[1] <= runner.span[1]:
            with per_call():
                hidden, cache = self.graph(token_ids, positions, cache_index, attention_mask, cache, *extra)
            return self.head(hidden[:, -1]), cache
        return runner(flat), cache

    def _runner(self, sig, flat):
        name = hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]
        if self.key is None:  # nothing to key a kept package on: build one for this process
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{name}.pt2"
                return self._build(path, sig, flat) or EAGER
        path = self.folder / self.key / f"{name}.pt2"
        package = Package.open(path, self.key, sig, self.program)
        if package is None and self.background:  # a child of this process may be writing it already
            package = Building.at(path)
        if package is None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                probe = path.parent / f".{os.getpid()}.probe"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:  # a read-only or full cache: compiled all the same, kept by no one
                warnings.warn(f"kvwire: cannot keep compiled steps in {path.parent} ({e}); this process "
                              f"compiles its own", stacklevel=4)
                with tempfile.TemporaryDirectory() as tmp:
                    return self._build(Path(tmp) / path.name, sig, flat) or EAGER
            package = self._build(path, sig, flat, kept=True)
        return package or EAGER

    def _build(self, path, sig, flat, kept=False):
        """Export, compile and keep the step of this signature at `path`: its Package; None where the
        graph cannot be exported (a decode step's: with a warning); with `background`, a `Building`
        whose compile runs in a child process where the package is `kept` (not a temporary one)."""
        from ..layers.attention import in_place_cache_writes

        chunk = sig[0]
        dims = None
        if chunk:
            # AUTO: guards its solver cannot prove for every length (true ones, such as
            # min(L + T, T * T + L * T) == L + T) narrow the range or stay runtime checks, not errors
            length = torch.export.Dim.AUTO(min=2, max=max(self.longest(flat[3].shape[1]), 2))
            dims = ({1: length}, {1: length}, None, None, (None,) * (len(flat) - 4))  # forward's *rest last
        try:
            # traced through a shell: export swaps fake tensors into the modules it traces, and a
            # thread reading the model meanwhile (a server lending a steering slot) must see real ones
            with torch.no_grad(), in_place_cache_writes(exports=True), compiled_steps():
                program = torch.export.export(shell(self.program), tuple(flat), dynamic_shapes=dims,
                                              strict=False)
        except Exception as e:  # noqa: BLE001 - a graph export cannot make: that signature runs eager
            if not chunk:  # torch.compile may still manage it (graph breaks): said, not silent
                first = (str(e).strip().splitlines() or [""])[0][:200]
                warnings.warn(f"kvwire: the decode step cannot be exported to compile it ahead of time "
                              f"({type(e).__name__}: {first}); it runs eager (lm.compile(ahead=False) tries "
                              f"torch.compile instead)", stacklevel=5)
            return None
        # tensors the trace created (not the model's): a package without weights cannot be handed them
        unbound = [n for n in program.graph_signature.lifted_tensor_constants if _tensor_of(self.program, n) is None]
        if unbound:
            return self._unbuildable(chunk, f"its graph holds tensors that are not the model's: {', '.join(unbound[:3])}")
        record = {"format": FORMAT, "key": self.key, "machine": machine(), "signature": sig,
                  "constants": constants_of(self.program), "span": chunk_span(program) if chunk else [1, 1]}
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.background and kept:
            return Building(program, path, record)
        keep(program, path, record)
        self.built += 1
        return self._open_built(path, sig, chunk)

    def _settle(self, building):
        """What a finished `Building` gives: its Package, or EAGER (its failure said, for a decode step)."""
        chunk, sig = building.record["signature"][0], building.record["signature"]
        if building.failure is not None:
            if not chunk:
                warnings.warn(f"kvwire: the decode step's compile in a child process failed "
                              f"({building.failure}); it runs eager", stacklevel=4)
            return EAGER
        self.built += 1
        package = self._open_built(building.path, sig, chunk)
        wrong = package and check_handed(package, building.shapes)
        if wrong:  # never served: removed, and the next process builds it again
            _discard(building.path)
            return self._unbuildable(chunk, f"the package its child process compiled is not used: {wrong}") or EAGER
        return package or EAGER

    def _open_built(self, path, sig, chunk):
        """The package just written at `path`, or None (named otherwise by the package than by the
        export: a tensor that is not the model's; the files removed)."""
        try:
            package = Package.open(path, self.key, sig, self.program, fresh=True)
        except Unbound as e:
            _discard(path)
            return self._unbuildable(chunk, str(e))
        if package is None:
            raise RuntimeError(f"the compiled step just written to {path} does not load")
        return package

    @staticmethod
    def _unbuildable(chunk, why):
        """None (the signature runs eager), said for a decode step (a chunk falls back silently)."""
        if not chunk:
            warnings.warn(f"kvwire: the decode step cannot be compiled ahead of time ({why}); it runs eager "
                          f"(lm.compile(ahead=False) tries torch.compile instead)", stacklevel=6)
        return None


class Package:
    """A loaded step: package(flat tensors) -> logits, the model's tensors handed to it by name."""

    def __init__(self, loader, constants, span, signature):
        self.loader, self.constants = loader, constants  # held: the loader reads them by pointer
        self.span = span  # the chunk lengths it takes, [first, last]
        self.signature = signature  # the calls it serves (`signature`)

    def __call__(self, flat):
        return self.loader.run(flat)[0]

    @classmethod
    def open(cls, path, key, sig, program, fresh=False):
        """The package at `path` if its record says it was made for this key, signature, torch and
        CPU and its bytes are intact; None otherwise (missing or made elsewhere: silently; damaged or
        unloadable: with a warning naming the file)."""
        record = path.with_suffix(".json")
        try:
            meta = json.loads(record.read_text())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as e:
            return _rebuilt(record, f"its record does not read ({e})")
        if not made_here(meta) or [meta.get("format"), meta.get("key")] != [FORMAT, key] or \
                meta.get("signature") != _jsonable(sig):
            return None  # another kvwire, torch or CPU (the key folds them in): build anew
        if not path.is_file() or file_digest(path) != meta.get("sha256"):
            return _rebuilt(path, "its bytes do not match the digest recorded when it was written")
        if meta.get("constants") != constants_of(program):
            return _rebuilt(path, "the model's tensors differ from those it was compiled for")
        try:
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            unbound = [name for name in loader.get_constant_fqns() if _tensor_of(program, name) is None]
            if unbound:
                raise Unbound(f"its graph holds tensors that are not the model's: {', '.join(unbound[:3])}")
            tensors = {name: _tensor_of(program, name).detach() for name in loader.get_constant_fqns()}
            loader.load_constants(tensors, False, True, True, False)  # user-managed: no copy of the weights
        except Exception as e:  # noqa: BLE001 - whatever torch's loader says, the file cannot serve
            if fresh:
                raise
            return _rebuilt(path, f"torch cannot load it ({type(e).__name__}: {e})")
        span = meta.get("span")
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(n, int) for n in span)):
            return _rebuilt(record, f"its record has no valid span of chunk lengths ({span!r})")
        return cls(loader, tensors, span, meta["signature"])


def signature(flat, chunk):
    """A call's signature as JSON-able lists: chunk flag, then each tensor's shape, stride and
    dtype (a chunk's token ids and positions without their length, which is dynamic)."""
    parts = [chunk, flat[0].device.type]
    for i, t in enumerate(flat):
        shape, stride = list(t.shape), list(t.stride())
        if chunk and i < 2:
            shape, stride = shape[:1], []
        parts.append([shape, stride, str(t.dtype)])
    return parts


def fast_key(flat, chunk):
    """What `signature` tells apart, as a hashable tuple made without converting shapes."""
    ids = tuple((t.shape[0], t.dtype) if chunk else (t.shape, t.stride(), t.dtype) for t in flat[:2])
    return chunk, flat[0].device, ids, tuple((t.shape, t.stride(), t.dtype) for t in flat[2:])


def chunk_span(program):
    """[first, last] chunk length an exported chunk program takes (export narrows the asked range
    where the graph needs it, say to lengths past a ring cache's slots)."""
    token_ids = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "token_ids")
    length = token_ids.meta["val"].shape[1]
    expr = length.node.expr if isinstance(length, torch.SymInt) else length
    if getattr(expr, "is_number", True):  # specialised to the example's length
        return [int(expr), int(expr)]
    bounds = program.range_constraints.get(expr)
    if bounds is None:  # a length tied to another symbol: only the example's is known to hold
        return [int(length.node.hint)] * 2
    return [int(bounds.lower), int(bounds.upper)]


def kept_folder():
    """Where packages are kept: `steps/` in kvwire's cache folder, one folder per `AheadDecode.key`."""
    return cache_root() / "steps"


def kept_packages():
    """Yield (record path, record read, bytes of package and record) of every package kept under
    `kept_folder()`; a record that does not read (half-written, removed meanwhile) is passed over."""
    folder = kept_folder()
    for record in sorted(folder.glob("*/*.json")) if folder.is_dir() else ():
        try:
            meta = json.loads(record.read_text())
            size = record.with_suffix(".pt2").stat().st_size + record.stat().st_size
        except (OSError, ValueError):
            continue
        yield record, meta, size


def discard(record):
    """Remove a kept package: its record first (a package without its record is never used), then
    the package, then its model's folder once that holds nothing else."""
    record.unlink(missing_ok=True)
    record.with_suffix(".pt2").unlink(missing_ok=True)
    try:
        record.parent.rmdir()
    except OSError:  # other packages (or a build's files) are still there
        pass


def made_here(record):
    """Whether a package's record (its .json, read) was made for this torch and CPU: others are
    never loaded here (their key folds the machine in)."""
    return isinstance(record, dict) and record.get("machine") == _jsonable(machine())


def machine():
    """What a compiled package depends on besides the model: torch and the CPU."""
    from ..kernels.cpu import cpuinfo_field, features_text

    return [torch.__version__, cpuinfo_field("vendor_id"), cpuinfo_field("model name"), features_text()]


def constants_of(program):
    """{name: [shape, stride, dtype]} of every parameter, buffer and tensor attribute of `program`."""
    out = {}
    for name, module in program.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}" if name else key] = value
        out.update({f"{name}.{k}" if name else k: t for k, t in module._parameters.items() if t is not None})
        out.update({f"{name}.{k}" if name else k: t for k, t in module._buffers.items() if t is not None})
    return {k: [list(t.shape), list(t.stride()), str(t.dtype)] for k, t in sorted(out.items())}


class Unbound(Exception):
    """A package names a constant the model does not hold (a tensor its trace created)."""


def _tensor_of(program, name):
    """The model's tensor at the dotted `name`, or None."""
    value = program
    for part in name.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _discard(path):
    """Remove the package at `path` and its record."""
    path.unlink(missing_ok=True)
    path.with_suffix(".json").unlink(missing_ok=True)


def _rebuilt(path, why):
    warnings.warn(f"kvwire: the compiled step {path} is not used: {why}; it is built again", stacklevel=3)
    return None


def _jsonable(value):
    return json.loads(json.dumps(value))
