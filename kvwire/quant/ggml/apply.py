"""Put ggml block weights into a model: the GGUF file's own (`use_gguf_blocks`) or freshly
quantised ones (`quantize_ggml`)."""
import os
import tempfile

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...io.gguf import GGUFFile
from ...layers.embedding import TokenEmbedding
from ..targets import linears, quantizable_head
from .linear import X16, GGMLLinear, qtype_of, x16_layout
from .packed import PackedBlocks
from .sources import row_sources

# llama.cpp's fallbacks when a row is not a whole number of 256-weight K-quant blocks
# (Gemma 3 270M's 640-wide rows): a 32-weight format with at least as many bits
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# Prompt tokens a prefill call of a model on ggml blocks runs at most (`CausalLM.prefill_call_tokens`;
# float models: 512). Quantising is for memory, and a call's activations are then a large part of it:
# 256-token calls lower the peak for a few percent of prefill speed (docs/kernels.md, Measurements).
PREFILL_CALL_TOKENS = 256


def quantize_ggml(lm, qtype, head=True, layers=True):
    """Quantise every `nn.Linear` of `lm.backbone` (`layers`) and the head (`head`) to a ggml
    format, in place. The head is quantised from its float weight (the tied embedding table), or,
    when it already runs on ggml blocks (a GGUF's own), re-quantised from those blocks.

    K-quant formats (q4_k, q6_k, ...) fall back per matrix to a 32-weight format when a row's
    length is not a multiple of 256, as llama.cpp does (q4_k -> q5_0, q6_k -> q8_0)."""
    qtype = qtype_of(qtype)

    def kind(width):
        return fitting(qtype, width)

    def make(weight, bias):
        return GGMLLinear.quantize(weight, kind(weight.shape[1]), bias)

    swaps = linears(lm) if layers else []
    target = quantizable_head(lm) if head else None
    # every weight is quantised before the model changes: a failure leaves it as it was
    new = [make(child.weight, child.bias) for _, _, child in swaps]
    head_weights = None
    if head:  # a head already in ggml blocks (a GGUF's own) is re-quantised from them, not the float table
        old = target.quantized
        head_weights = old.requantize(kind(old.in_features)) if isinstance(old, GGMLLinear) else \
            make(lm.head.weight, None)
    for (parent, name, _), module in zip(swaps, new):
        setattr(parent, name, module)
    if head:
        target.quantized = head_weights
    if layers:
        lm.prefill_call_tokens = PREFILL_CALL_TOKENS
    lm.reset_caches()
    return lm


def fitting(qtype, width):
    """`qtype`, or llama.cpp's 32-weight fallback for a K-quant whose rows of `width` weights are not
    whole 256-weight super-blocks."""
    qtype = qtype_of(qtype)
    return qtype_of(_FALLBACK[qtype.name]) if width % 256 and qtype.name in _FALLBACK else qtype


def use_gguf_blocks(lm, path, head=None, cache=None, gguf=None):
    """Swap every linear map whose weight is quantised in the GGUF file at `path` for a
    `GGMLLinear` on the file's own blocks (memory-mapped), head included; token embeddings whose
    table is quantised there look their rows up in it (`TokenEmbedding.quantized`). In place;
    returns `lm`.
    `head`: a ggml type the head is re-quantised to instead, read from the file's blocks a chunk of
    rows at a time, each chunk's pages given back once read: the file's head is never held whole
    (Gemma 3's 178 MB Q8_0 head to a 115 MB Q5_0 one: a 0.62 GB peak over the load and a 512-token
    prompt, against 0.85 GB re-quantising a loaded head with `kw.quantize(lm, "q5_0", layers=False)`).
    `cache`: a folder (the file's kvwire cache entry) where the re-quantised head and the blocks this
    load copies (repacked for x16, rows reordered) are kept (`packed.PackedBlocks`), so the next load
    maps them instead of making them again (~0.9 s for Gemma 3's head, most of a warm load for a
    repacked model); None: nothing kept. `gguf`: the file's `GGUFFile` when the caller has it open
    (its header is not parsed again: 0.16 s for Gemma 3's 262k-token vocabulary).

    Which tensor (and which of its rows) feeds which weight is found by running the family's GGUF
    converter on row numbers instead of values: converters may split or reorder whole rows (GPT-2
    splits the fused q/k/v), never mix values within a row, so the numbers come out where the rows go.
    """
    from ...models import by_gguf_architecture  # the models import the quant package

    gguf = GGUFFile(path) if gguf is None else gguf
    family = by_gguf_architecture(gguf.architecture, path)
    sources = row_sources(family, gguf, lm.config)
    packed = None if cache is None else PackedBlocks(cache)
    keys = _keys_of(lm)
    swapped = 0
    for parent, name, child in linears(lm):
        key = keys.get(id(child.weight), (None,))[0]
        if key in sources:
            setattr(parent, name, _blocks_for(gguf, sources[key], child.weight, child.bias, packed=(packed, key)))
            swapped += 1
    head_key = keys.get(id(lm.head.weight), (None,))[0]
    if head_key in sources:
        target = quantizable_head(lm)
        target.quantized = _blocks_for(gguf, sources[head_key], lm.head.weight, None, head, cache,
                                       packed=(packed, head_key))
        swapped += 1
    elif head is not None:
        raise ValueError(f"{path} has no quantised head to re-quantise to {head!r} (its head is float): load "
                         f"without head=, then kw.quantize(lm, {head!r}, layers=False)")
    for embedding in lm.backbone.modules():  # lookups read the file's table, not a float copy
        key = keys.get(id(embedding.weight), (None,))[0] if isinstance(embedding, TokenEmbedding) else None
        if key in sources:  # on the file's own pages, in ggml's layout: only the rows looked up are read
            embedding.quantized = _blocks_for(gguf, sources[key], embedding.weight, None, kernel="ggml")
    if not swapped:
        raise ValueError(f"{path} holds no quantised linear weights for ggml kernels (all float?)")
    if packed is not None:
        packed.save()
    lm.prefill_call_tokens = PREFILL_CALL_TOKENS
    lm.reset_caches()
    return lm


def _blocks_for(gguf, source, weight, bias, requantize=None, cache=None, kernel=None, packed=(None, None)):
    """A GGMLLinear on the rows `source` names, after checking that they are `weight`'s rows: the
    C kernels read `in_features` weights a row of the type unchecked. `requantize`: a ggml type the
    rows are re-quantised to instead (from the file's blocks, their pages given back chunk by chunk).
    `kernel`: "ggml" keeps the file's layout (no copy), None the CPU's choice (`ggml_kernel`).
    `packed`: (a `PackedBlocks` or None, the weight's name there): where blocks copied from the file
    (repacked, rows reordered) are read from when an earlier load kept them, and kept for the next."""
    name, rows = source
    qtype, blocks = gguf.blocks(name)
    dims = next(d for n, d, _, _ in gguf.infos if n == name)
    if len(rows) != weight.shape[0] or dims[0] != weight.shape[1] or len(dims) != 2 or \
            rows.min() < 0 or rows.max() >= blocks.shape[0]:
        raise ValueError(f"{gguf.path}: GGUF tensor {name!r} of dimensions {dims} gives {len(rows)} rows of "
                         f"{dims[0]} for a weight of shape {tuple(weight.shape)}")
    whole = len(rows) == blocks.shape[0] and np.array_equal(rows, np.arange(len(rows)))
    store, key = packed
    # rows repacked for x16 are not read from the file again: their pages go back as they are copied
    release = (lambda start, stop: gguf.forget(blocks[start:stop])) if whole else None
    try:  # GGMLLinear checks the row bytes against ggml's own size for the type
        if requantize is not None:
            picked = torch.from_numpy(blocks if whole else np.ascontiguousarray(blocks[rows]))
            target = fitting(requantize, weight.shape[1])
            layout = "x16" if x16_layout(target) else "ggml"
            kept = None if cache is None else cache / f"{name}.{target.name.lower()}.{layout}.safetensors"
            module = _kept(kept, target, weight, bias)
            if module is None:
                module = _requantized(GGMLLinear(picked, qtype, weight.shape[1], bias, kernel="ggml"), target, release)
                _keep(kept, module)
        else:
            kernel_type = X16[qtype] if x16_layout(qtype, kernel) else int(qtype)
            mapped = None if store is None or (whole and kernel_type == int(qtype)) else \
                store.get(key, kernel_type, (len(rows), blocks.shape[1]), rows)
            if mapped is not None:  # the copy an earlier load made, memory-mapped: the file's blocks are not read
                return GGMLLinear.in_kernel_layout(mapped, qtype, weight.shape[1], bias, kernel)
            picked = torch.from_numpy(blocks if whole else np.ascontiguousarray(blocks[rows]))
            module = GGMLLinear(picked, qtype, weight.shape[1], bias, kernel=kernel, release=release)
            if store is not None and (not whole or module.blocks.data_ptr() != picked.data_ptr()):  # a copy
                store.put(key, module.blocks, module.kernel_type, rows)
    except ValueError as e:
        raise ValueError(f"{gguf.path}: GGUF tensor {name!r}: {e}") from e
    if whole and module.blocks.data_ptr() != picked.data_ptr():  # copied: the file's pages are not read again
        gguf.forget(blocks)
    return module


def _requantized(source, qtype, release):
    """`source` (ggml's layout, on a file's pages) re-quantised to `qtype`, rows read a chunk at a time
    and `release(start, stop)` called once each chunk is read (None: nothing called)."""
    def rows_of(start, stop):
        part = source._dequantized(start, stop)
        if release is not None:
            release(start, stop)
        return part
    bias = None if source.bias is None else source.bias.detach()
    return GGMLLinear._quantized(rows_of, qtype, source.out_features, source.in_features, bias)


def _kept(file, qtype, weight, bias):
    """The GGMLLinear kept in `file` by an earlier load (in this CPU's kernel layout, memory-mapped:
    nothing to repack), or None (none kept, or a file that does not read back as `weight`'s rows in
    `qtype`: it is made again)."""
    if file is None or not file.is_file():
        return None
    try:
        blocks = load_file(str(file))["blocks"]
        if blocks.dim() != 2 or blocks.shape[0] != weight.shape[0]:
            return None
        return GGMLLinear.in_kernel_layout(blocks, qtype, weight.shape[1], bias)
    except (OSError, ValueError, KeyError, SafetensorError):
        return None


def _keep(file, module):
    """Write `module`'s blocks as they are (its kernel's layout) to `file`, atomically; a read-only or
    full disk skips it."""
    if file is None:
        return
    tmp = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)  # a load on blocks may come before any float entry
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        os.close(fd)
        save_file({"blocks": module.blocks.contiguous()}, tmp)
        os.replace(tmp, file)
    except (OSError, SafetensorError):
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _keys_of(lm):
    """{id(parameter): (its key in the backbone, the parameter)}: held, so no id is reused while the
    linear maps are swapped."""
    return {id(param): (key, param) for key, param in lm.backbone.named_parameters(remove_duplicate=False)}
