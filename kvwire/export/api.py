"""`kw.export` and `kw.load_exported`."""
import json
import shutil
import time
from pathlib import Path

import torch

from ..dtypes import weights_dtype
from .program import ExportProgram
from .runtime import ExportedLM, RuntimeGraph, dtype_name, executorch_runner, onnx_runner, read_meta, sidecar

FORMATS = {".onnx": "onnx", ".pte": "executorch", ".mlpackage": "coreml"}
DEFAULT_MAX_LENGTH = 1024


def export(lm, path, max_length=None, batch_size=1, dtype=None, *, format=None, all_logits=False,
           overwrite=False, quantize=None, stateful=True, delegate="xnnpack", prefill_length=None):
    """Export the cached graph of `lm` (edits included) plus its head as one model file.

    Args:
        lm: a CausalLM, edited or not. path: ".onnx", ".pte" or ".mlpackage" (or give `format`).
        max_length: cache timeline length, fixed in the file (default min(1024, context)).
        batch_size: rows per call where the batch is static (Core ML, ExecuTorch; fewer rows are
            padded at run time); ONNX takes any batch and chunks of 1..max_length tokens.
        prefill_length: Core ML and ExecuTorch, whose shapes are static: the chunk length(s) of
            the prefill entry points, besides the one-token decode step (an int; ExecuTorch also
            a tuple). Default 64 (Core ML) and (64, 8) (ExecuTorch). `load_exported` left-pads a
            prompt (masked) to a whole number of the shortest prefill chunk when the cache has
            room, else runs it as pieces of the exported lengths; every entry point shares one
            copy of the weights.
        dtype: weights dtype to export, a torch dtype or its name (default: the model's own); ONNX
            takes float32 only (onnxruntime's CPU kernels).
        format: "onnx", "executorch" or "coreml" when the suffix does not say.
        all_logits: output logits for every position of a chunk, not only the last.
        overwrite: replace an existing file. quantize: ONNX only: "int8" or "int4" weight-only.
        stateful: Core ML only: KV cache as model state (iOS 18) or as inputs/outputs.
        delegate: ExecuTorch only: "xnnpack" (default) or "portable" (no delegate, faster export).
    Returns a dict report: format, path, seconds, bytes, signature.

    Inputs of the file: token_ids, positions, cache_index, attention_mask, past.{i}.key/value per
    cached layer, runtime inputs (e.g. steer_strength); outputs: logits, present.{i}.key/value.
    Metadata (signature, defaults, tokenizer) goes to `<path>.kvwire.json`.

    Example:
        >>> kw.export(lm.steer(vec, 4.0), "steered.onnx", max_length=256)
        >>> kw.load_exported("steered.onnx").generate("I think", max_new_tokens=16)
    """
    path = Path(path)
    fmt = _format(path, format)
    max_length = _max_length(lm, max_length)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if quantize is not None and fmt != "onnx":
        raise ValueError(f"quantize={quantize!r} is an ONNX option; {fmt} export takes the model's weights")
    _refuse_unexportable(lm)
    if delegate != "xnnpack" and fmt != "executorch":
        raise ValueError(f"delegate={delegate!r} is an ExecuTorch option")
    lengths = _chunk_lengths(fmt, prefill_length, max_length)
    dtype = None if dtype is None else weights_dtype(dtype)
    weights = dtype or next(lm.parameters()).dtype
    if fmt == "onnx" and weights != torch.float32:
        # onnxruntime's CPU provider has no bfloat16/float16 kernels for several of the graph's
        # ops (Mul, Softmax): the file would be written but fail at load (NOT_IMPLEMENTED)
        raise ValueError(f"ONNX export of {dtype_name(weights)} weights: onnxruntime's CPU kernels cannot run them; "
                         f"pass dtype='float32' (the weights are converted; quantize='int8'/'int4' makes it smaller)")
    _make_room(path, overwrite)
    if dtype is not None and dtype != next(lm.parameters()).dtype:
        import copy
        lm = copy.deepcopy(lm).to(dtype)
    start = time.perf_counter()
    if fmt == "coreml":
        from .coreml import to_coreml
        prog = ExportProgram(lm, max_length, all_logits, int_dtype=torch.int32, mask_dtype=torch.int32).eval()
        to_coreml(prog, path, batch_size, stateful, lengths[0])
    else:
        prog = ExportProgram(lm, max_length, all_logits).eval()
        if fmt == "onnx":
            from .onnx import to_onnx
            to_onnx(prog, path, quantize)
        else:
            from .executorch import to_executorch
            to_executorch(prog, path, batch_size, lengths, delegate)
    seconds = time.perf_counter() - start
    meta = _meta(lm, prog, fmt, batch_size, stateful, lengths)
    sidecar(path).write_text(json.dumps(meta))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    data = Path(str(path) + ".data")
    size += data.stat().st_size if data.is_file() else 0
    return {"format": fmt, "path": str(path), "seconds": seconds, "bytes": size, "inputs": meta["inputs"],
            "outputs": meta["outputs"]}


def load_exported(path, tokenizer=None, threads=None):
    """An `ExportedLM` over an exported .onnx (onnxruntime) or .pte (ExecuTorch runtime) file.

    tokenizer: a kvwire Tokenizer; default: the one saved at export. generate / stream /
    samplers / beam search work as on the eager model. Core ML packages need macOS to run.

    Example:
        >>> lm = kw.load_exported("model.onnx")
        >>> lm.generate("The capital of France is", max_new_tokens=8)
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no exported model at {path}")
    fmt = _format(path, None)
    meta = read_meta(path)
    if fmt == "coreml":
        raise RuntimeError("Core ML packages run only on macOS (coremltools cannot predict on Linux); "
                           "use the .onnx or .pte export here")
    run = onnx_runner(path, threads) if fmt == "onnx" else executorch_runner(path, meta.get("chunk_lengths"))
    if tokenizer is None and meta.get("tokenizer"):
        tokenizer = _tokenizer(meta)
    return ExportedLM(RuntimeGraph(meta, run), tokenizer, meta)


def _refuse_unexportable(lm):
    """ValueError naming the first layer an exporter cannot represent (a module whose class says
    `exportable = False`, e.g. one on CPU-only quantised kernels)."""
    for name, m in lm.named_modules():
        if not getattr(m, "exportable", True):
            kernels = getattr(m, "cpu_only", None) or type(m).__name__
            raise ValueError(f"this model's layers were quantised with kw.quantize or quantize='gguf' ({name!r}: "
                             f"{kernels}, CPU kernels that no export runtime has); export the float model, "
                             f"with quantize='int4' or 'int8' for ONNX")


def _format(path, format):
    if format is not None:
        if format not in FORMATS.values():
            raise ValueError(f"unknown export format {format!r}; expected one of {sorted(FORMATS.values())}")
        return format
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell the export format from {path.name!r}: use a suffix in "
                         f"{sorted(FORMATS)} or format= one of {sorted(FORMATS.values())}")
    return fmt


def _max_length(lm, max_length):
    context = lm.max_context
    if max_length is None:
        return min(DEFAULT_MAX_LENGTH, context or DEFAULT_MAX_LENGTH)
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
    if context is not None and max_length > context:
        raise ValueError(f"max_length {max_length} is beyond the model's context of {context} tokens")
    return max_length


def _chunk_lengths(fmt, prefill_length, max_length):
    """Static chunk lengths to export, longest first, ending with 1; None for ONNX (dynamic)."""
    if fmt == "onnx":
        if prefill_length is not None:
            raise ValueError(f"prefill_length={prefill_length!r} is a Core ML / ExecuTorch option; "
                             "ONNX takes chunks of any length")
        return None
    given = prefill_length if prefill_length is not None else (64 if fmt == "coreml" else (64, 8))
    lengths = given if isinstance(given, (tuple, list)) else (given,)
    if fmt == "coreml" and len(lengths) != 1:
        raise ValueError(f"Core ML takes one prefill_length; got {prefill_length!r}")
    if not lengths or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths):
        raise ValueError(f"prefill_length must be a positive int or a tuple of them; got {prefill_length!r}")
    return sorted({min(n, max_length) for n in lengths} | {1}, reverse=True)


def _make_room(path, overwrite):
    if path.exists() or sidecar(path).exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        sidecar(path).unlink(missing_ok=True)
        Path(str(path) + ".data").unlink(missing_ok=True)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"folder {path.parent} does not exist")


def _meta(lm, prog, fmt, batch_size, stateful, lengths):
    sig = prog.signature()
    tok = lm.tokenizer
    return {
        "kvwire_export": 1, "format": fmt, "max_length": sig.max_length, "batch_size": batch_size,
        "stateful": stateful if fmt == "coreml" else None, "all_logits": prog.all_logits,
        "static_batch": batch_size if fmt in ("executorch", "coreml") else None,
        "chunk_lengths": lengths,  # static entry points (longest first), None: any length
        "inputs": [(n, list(s), dtype_name(d)) for n, s, d in sig.inputs], "outputs": list(sig.outputs),
        "runtime_inputs": list(sig.runtime_inputs), "runtime_defaults": prog.default_runtime_inputs(),
        "vocab_size": lm.vocab_size, "max_context": lm.max_context, "eos_token_ids": list(lm.eos_token_ids),
        "tokenizer": None if tok is None else {"json": tok.backend.to_str(), "bos_token_id": tok.bos_token_id,
                                               "eos_token_ids": list(tok.eos_token_ids), "add_bos": tok.add_bos},
    }


def _tokenizer(meta):
    from tokenizers import Tokenizer as Backend

    from ..io.tokenizer import Tokenizer

    t = meta["tokenizer"]
    return Tokenizer(Backend.from_str(t["json"]), t["bos_token_id"], t["eos_token_ids"], t["add_bos"])
