"""Ready-made `clone` functions: pick layer calls by name, glob, index range or type, and insert
after / before them, replace them or skip them; each is one line.

Selectors (`where`):
- a dotted pattern: "layers.3", "layers.*" (glob per segment), "layers.4-12" (inclusive range);
- a layer class: every call whose layer is an instance (e.g. `kvwire.layers.Block`);
- a function `(name, layer) -> bool`;
- a list of these (their union).
A selector that matches nothing, or a range reaching past the layers that exist, is an error.

Example:
    >>> edited = kw.clone(backbone, kw.insert_after("layers.4-12", lambda name, layer: Shift(v)))
    >>> lm2 = lm.edit(kw.skip("layers.7"))
"""
import fnmatch
import re

from torch import nn

from ..layers.base import Block
from .clone import current_call
from .trace import layer_calls, trace

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def select(module, where, depth="block"):
    """Dotted names of the layer calls of `module` that `where` picks, in graph order.

    Example:
        >>> kw.select(backbone, "layers.1-2")
        ['layers.1', 'layers.2']
    """
    gm = trace(module, depth=depth)
    return _resolve(gm, [n.target for n in layer_calls(gm)], where)


def block_calls(module):
    """Dotted names of the decoder-block calls of a backbone (or clone), in order."""
    return select(module, Block)


def numbered_blocks(module):
    """{block index: dotted name} of the decoder blocks a backbone (or clone) still calls.

    The index is the block's own number in the checkpoint (`layers.7` -> 7), which is what control
    vectors and llama.cpp count, so it survives edits: after `kw.skip("layers.1")` the blocks are
    {0: "layers.0", 2: "layers.2", ...}. A block counts when it is called, or when its inner layers
    are (a clone made at "layer" depth). Blocks without a number (a new block put in by `replace`)
    are left out.

    Example:
        >>> numbered_blocks(lm.edit(kw.skip("layers.1")).backbone)
        {0: 'layers.0', 2: 'layers.2', 3: 'layers.3'}
    """
    gm = trace(module)
    out = {}
    for call in [n.target for n in layer_calls(gm)]:
        name = _owning_block(gm, call)
        tail = (name or "").rpartition(".")[2]
        if tail.isdigit():
            out.setdefault(int(tail), name)
    return out


def _owning_block(gm, call):
    """The dotted name of the outermost `Block` that is `call` or holds it, or None."""
    parts, blocks = call.split("."), set(gm.meta.get("kvwire_blocks", ()))
    return next((name for name in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if name in blocks), None)


def summarize_indices(indices):
    """'0, 2-5, 7': sorted ints with consecutive runs collapsed."""
    runs = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _resolve(gm, names, where):
    selectors = list(where) if isinstance(where, (list, tuple)) else [where]
    if not selectors:
        raise ValueError("empty selector list; expected a name pattern, a layer class or a function")
    picked = set()
    for sel in selectors:
        found = _match(gm, names, sel)
        if not found:
            raise ValueError(f"selector {sel!r} matches no layer call; the calls are: {_summary(names)}")
        picked.update(found)
    return [n for n in dict.fromkeys(names) if n in picked]


def _match(gm, names, sel):
    if isinstance(sel, str):
        return _match_pattern(names, sel)
    if isinstance(sel, type):
        return [n for n in names if isinstance(gm.get_submodule(n), sel)]
    if callable(sel):
        return [n for n in names if sel(n, gm.get_submodule(n))]
    raise TypeError(f"a selector is a name pattern, a layer class or a function (name, layer) -> bool; "
                    f"got {type(sel).__name__}")


def _match_pattern(names, pattern):
    parts = pattern.split(".")
    found = [n for n in names if _parts_match(n.split("."), parts)]
    for i, part in enumerate(parts):
        m = _RANGE.match(part)
        if not m:
            continue
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"selector {pattern!r}: range {part} is empty (start > end)")
        # the indices that exist at this position among calls otherwise matching the pattern
        loose = parts[:i] + ["*"] + parts[i + 1:]
        have = sorted({int(n.split(".")[i]) for n in names
                       if _parts_match(n.split("."), loose) and n.split(".")[i].isdigit()})
        if have and (lo < have[0] or hi > have[-1]):
            where = ".".join(parts[:i])
            raise ValueError(f"selector {pattern!r}: index {lo if lo < have[0] else hi} is out of range; "
                             f"{where} has indices {summarize_indices(have)}")
    return found


def _parts_match(name_parts, parts):
    if len(name_parts) != len(parts):
        return False
    for got, want in zip(name_parts, parts):
        m = _RANGE.match(want)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if not (got.isdigit() and lo <= int(got) <= hi):
                return False
        elif not fnmatch.fnmatchcase(got, want):
            return False
    return True


def _summary(names):
    """'embed_tokens, layers.0-17, norm': consecutive numbered calls collapsed, gaps kept
    ('layers.0, layers.2-3' after a skip)."""
    out, runs = [], {}
    for n in dict.fromkeys(names):
        head, _, tail = n.rpartition(".")
        if head and tail.isdigit():
            if head not in runs:
                runs[head] = []
                out.append(head)
            runs[head].append(int(tail))
        else:
            out.append(n)
    return ", ".join(", ".join(f"{n}.{part}" for part in summarize_indices(runs[n]).split(", "))
                     if n in runs else n for n in out)


class Edit:
    """A `clone` fn that changes the calls picked by `where` and leaves the others as they are."""

    def __init__(self, where):
        self.where = where
        self.picked = None

    def prepare(self, gm, names):
        """Called by `clone` before the rebuild: resolve the selector on the calls that exist."""
        self.picked = set(_resolve(gm, names, self.where))

    def __call__(self, layer, *args, **kwargs):
        if self.picked is None:
            raise RuntimeError(f"{type(self).__name__} is a clone fn: pass it to kw.clone(module, edit) "
                               f"or lm.edit(edit)")
        name = current_call()
        if name in self.picked:
            return self.apply(name, layer, *args, **kwargs)
        return layer(*args, **kwargs)

    def apply(self, name, layer, *args, **kwargs):
        raise NotImplementedError


class _WithNew(Edit):
    def __init__(self, where, make):
        super().__init__(where)
        if not (isinstance(make, nn.Module) or callable(make)):
            raise TypeError(f"expected an nn.Module or a function (name, layer) -> nn.Module, got {make!r}")
        self.make = make

    def new(self, name, layer):
        module = self.make if isinstance(self.make, nn.Module) else self.make(name, layer)
        if not callable(module):
            raise TypeError(f"the function given for {name!r} returned {type(module).__name__}, not a module")
        return module


class InsertAfter(_WithNew):
    """Call a new layer on the output of every picked call: `new(layer(x))`.

    make: an nn.Module (shared by every pick) or `(name, layer) -> nn.Module` (one per pick).
    """

    def apply(self, name, layer, *args, **kwargs):
        return self.new(name, layer)(layer(*args, **kwargs))


class InsertBefore(_WithNew):
    """Call a new layer on the (first) input of every picked call: `layer(new(x))`."""

    def apply(self, name, layer, x, *args, **kwargs):
        return layer(self.new(name, layer)(x), *args, **kwargs)


class Replace(_WithNew):
    """Call a new layer instead of every picked call, with the same inputs."""

    def apply(self, name, layer, *args, **kwargs):
        return self.new(name, layer)(*args, **kwargs)


class Skip(Edit):
    """Leave the picked calls out: their input passes through (decoder blocks, norms)."""

    def apply(self, name, layer, *args, **kwargs):
        if len(args) != 1 or kwargs:
            raise ValueError(f"cannot skip {name!r}: it takes {len(args)} inputs; skip needs exactly one")
        return args[0]


def insert_after(where, make):
    """A clone fn calling `make`'s layer on the output of every call `where` picks.

    make: an nn.Module (shared by every pick) or `(name, layer) -> nn.Module` (one per pick).

    Example:
        >>> lm2 = lm.edit(kw.insert_after("layers.*", lambda name, layer: Shift(v)))
    """
    return InsertAfter(where, make)


def insert_before(where, make):
    """A clone fn calling `make`'s layer on the input of every call `where` picks."""
    return InsertBefore(where, make)


def replace(where, make):
    """A clone fn calling `make`'s layer instead of every call `where` picks (same inputs)."""
    return Replace(where, make)


def skip(where):
    """A clone fn leaving out every call `where` picks (its input passes through)."""
    return Skip(where)
