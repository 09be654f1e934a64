"""Exported models driven by kvwire's generation loop: `ExportedLM` gives the engine a `Runner`
whose cached graph is a runtime session (onnxruntime, ExecuTorch), so generate / stream /
samplers / beam search behave as in eager mode."""
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..generate import request
from ..generate.methods import GenerationMethods
from ..generate.pool import CachePool
from ..generate.runner import Runner

_DTYPES = {"int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "float32": torch.float32}


def _kind(dtype):
    return "float" if dtype.is_floating_point else "bool" if dtype == torch.bool else "int"


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


class RuntimeGraph:
    """Looks like a `CachedGraph` to `Session`, runs an exported program.

    Caches are torch tensors of the exported shapes (max_length fixed at export); the mask a
    caller gives may be shorter and is padded with invalid slots. Inputs are checked against the
    exported signature before they reach the runtime.
    """

    def __init__(self, meta, run):
        self.meta, self.run = meta, run
        self.inputs = [(n, tuple(s), _DTYPES[d]) for n, s, d in meta["inputs"]]
        self.max_length = meta["max_length"]
        self.runtime_inputs = {n: d for n, _, d in self.inputs if n in meta["runtime_inputs"]}

    def init_cache(self, batch_size, max_length, dtype=None, device=None):
        if max_length > self.max_length:
            raise ValueError(f"this model was exported for max_length {self.max_length}; {max_length} requested")
        shapes = [(n, s) for n, s, _ in self.inputs if n.startswith("past.")]
        flat = [torch.zeros((batch_size, *s[1:]), dtype=torch.float32) for _, s in shapes]
        return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))

    def default_inputs(self, batch_size, prompt_lengths=None):
        out = {}
        for name, dtype in self.runtime_inputs.items():
            value = self.meta["runtime_defaults"][name]
            if value == "prompt_length":
                rows = prompt_lengths if prompt_lengths is not None else torch.zeros(batch_size)
                out[name] = torch.as_tensor(rows, dtype=torch.int64)
            else:
                out[name] = torch.full((batch_size,), value, dtype=torch.float32 if dtype.is_floating_point
                                       else torch.int64)
        return out

    def __call__(self, token_ids, positions, cache_index, attention_mask, cache, **inputs):
        lengths = self.meta.get("chunk_lengths")
        if lengths and token_ids.shape[-1] not in lengths:
            return self._in_pieces(lengths, token_ids, positions, cache_index, attention_mask, cache, inputs)
        B, T = token_ids.shape[0], token_ids.shape[-1]
        if not 0 <= int(cache_index) <= self.max_length - T:
            raise ValueError(f"chunk of {T} tokens at cache_index {int(cache_index)} does not fit the exported "
                             f"max_length {self.max_length}")
        if attention_mask.shape[-1] < self.max_length:
            pad = torch.zeros(B, self.max_length - attention_mask.shape[-1], dtype=attention_mask.dtype)
            attention_mask = torch.cat([attention_mask, pad], dim=1)
        values = inputs if set(inputs) >= set(self.runtime_inputs) else {**self.default_inputs(B), **inputs}
        unknown = set(values) - set(self.runtime_inputs)
        if unknown:
            raise TypeError(f"unknown runtime inputs {sorted(unknown)}; this model takes "
                            f"{sorted(self.runtime_inputs) or 'none'}")
        flat = [t for pair in cache for t in pair]
        given = [token_ids, positions, torch.as_tensor(cache_index), attention_mask, *flat,
                 *[values[n] for n in self.runtime_inputs]]
        feeds = self.check(given)
        static = self.meta.get("static_batch")
        if static:
            if B > static:
                raise ValueError(f"this model was exported for batches of {static} rows; got {B}")
            feeds = {k: _pad_rows(v, static) if v.dim() else v for k, v in feeds.items()}
        outputs = [torch.as_tensor(np.asarray(t))[:B] for t in self.run(feeds)]
        logits, rest = outputs[0], outputs[1:]
        return logits, tuple((rest[i], rest[i + 1]) for i in range(0, len(rest), 2))

    def _in_pieces(self, lengths, token_ids, positions, cache_index, attention_mask, cache, inputs):
        """A chunk the program has no entry point for, as consecutive pieces of exported lengths
        (longest first). Same result: each piece sees the cache its predecessors wrote."""
        T, start, logits = token_ids.shape[-1], 0, []
        for n in lengths:
            while T - start >= n:
                part, cache = self(token_ids[:, start:start + n], positions[:, start:start + n],
                                   torch.as_tensor(cache_index) + start, attention_mask, cache, **inputs)
                logits.append(part)
                start += n
        return (torch.cat(logits, dim=1) if self.meta["all_logits"] else logits[-1]), cache

    def check(self, given):
        """Cast integer/bool inputs to the exported dtypes and check every shape: {name: tensor}."""
        if len(given) != len(self.inputs):
            raise ValueError(f"expected {len(self.inputs)} inputs ({[n for n, _, _ in self.inputs]}), got {len(given)}")
        B, T = given[0].shape if given[0].dim() == 2 else (None, None)
        feeds = {}
        for (name, shape, dtype), value in zip(self.inputs, given):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"input {name!r} must be a tensor, got {type(value).__name__}")
            want = tuple(B if s == "batch" else T if s == "chunk" else s for s in shape)
            # integer inputs may come as int32 or int64; floats and the bool mask must match exactly
            ok_dtype = value.dtype == dtype or (_kind(value.dtype) == _kind(dtype) == "int")
            if tuple(value.shape) != want or not ok_dtype:
                raise ValueError(f"input {name!r} must be {dtype_name(dtype)} of shape {want}; "
                                 f"got {dtype_name(value.dtype)} of shape {tuple(value.shape)}")
            feeds[name] = value.to(dtype)
        return feeds


def _pad_rows(t, rows):
    """t with zero rows appended up to `rows` (masked out: their attention mask is all False)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)])


class ExportedLM(GenerationMethods):
    """A model over an exported file: `generate`, `stream`, `chat`, samplers and beam search as
    in eager mode, run by the same engine through the file's `Runner`.

    Uncached calls (`lm(ids)`, `score`, `perplexity`) need a file exported with all_logits=True
    (otherwise the program returns the last position's logits only).

    Example:
        >>> onnx_lm = kw.load_exported("model.onnx")
        >>> onnx_lm.generate("The capital of France is", max_new_tokens=8)
    """

    def __init__(self, graph, tokenizer, meta):
        self.cached, self.tokenizer, self.meta = graph, tokenizer, meta
        self.pool = CachePool()  # caches at the exported length, kept between calls
        self.device = torch.device("cpu")
        self.prefill_call_tokens = None  # as `CausalLM.prefill_call_tokens`

    @property
    def vocab_size(self):
        return self.meta["vocab_size"]

    @property
    def max_context(self):
        return min(self.meta["max_length"], self.meta.get("max_context") or self.meta["max_length"])

    @property
    def eos_token_ids(self):
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.meta.get("eos_token_ids", ()))

    def runner(self):
        """The program as a `Runner`: caches at the exported length, prompts padded to whole chunks
        of a prefill entry point; one write index for the batch, so the engine runs rows in lockstep
        and does not use the prefix store (a row's cache cannot be seeded at another index)."""
        length = self.meta["max_length"]
        return Runner(self.cached, nn.Identity(), self.vocab_size, self.device, self.max_context, self.tokenizer,
                      self.eos_token_ids, prefill_call_tokens=self.prefill_call_tokens,
                      cache_length=lambda n: length, multiple=self._multiple, pool=self.pool)

    def reset_caches(self):
        """Free the caches kept between calls and the prefix store's entries."""
        self.pool.clear()
        if self._prefix_store is not None:
            self._prefix_store.clear()

    def __call__(self, token_ids):
        return self.forward(token_ids)

    def forward(self, token_ids):
        """Uncached logits (B, T, V) of a file exported with all_logits=True: one run of the
        program from an empty cache (runtime inputs at their defaults)."""
        if not self.meta.get("all_logits"):
            raise NotImplementedError("this model was exported with the last position's logits only; call "
                                      "generate or stream, or export with all_logits=True for lm(ids) and score")
        request.uncached_input(token_ids, self.vocab_size, self.max_context, self.device)
        B, T = token_ids.shape
        cache = self.cached.init_cache(B, self.meta["max_length"])
        mask = torch.ones(B, self.meta["max_length"], dtype=torch.bool)
        positions = torch.arange(T)[None].expand(B, T)
        logits, _ = self.cached(token_ids, positions, 0, mask, cache)
        return logits.float()

    def _multiple(self, longest, max_length):
        """Static chunk lengths: left-pad prompts to whole chunks of the shortest prefill entry
        point when the padding fits, so no prompt tail runs token by token."""
        prefills = [n for n in self.meta.get("chunk_lengths") or () if n > 1]
        multiple = min(prefills) if prefills else 1
        return 1 if max_length + (-longest % multiple) > self.meta["max_length"] else multiple

    def edit(self, fn, depth="block"):
        raise TypeError("an exported model cannot be edited; edit the eager model and export it again")

    def steer(self, vector, strength=1.0, **options):
        raise TypeError("an exported model cannot be steered by adding a vector; steer the eager model and "
                        "export it again (its strengths stay runtime inputs: generate(..., inputs=...))")


def read_meta(path):
    side = sidecar(path)
    if not side.is_file():
        raise FileNotFoundError(f"{path} has no kvwire metadata ({side.name}); export it with kw.export")
    return json.loads(side.read_text())


def sidecar(path):
    return Path(str(path) + ".kvwire.json")


def onnx_runner(path, threads=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, {k: v.numpy() for k, v in feeds.items()})


def executorch_runner(path, lengths=None):
    """Runs feeds through the program's method for their chunk length (files exported before
    static chunk lengths have one dynamic method, "forward")."""
    from executorch.runtime import Runtime

    from .executorch import method_name

    program = Runtime.get().load_program(str(path))
    if not lengths:
        method = program.load_method("forward")
        return lambda feeds: method.execute([t.contiguous() for t in feeds.values()])
    methods = {n: program.load_method(method_name(n)) for n in lengths}
    return lambda feeds: methods[feeds["token_ids"].shape[1]].execute([t.contiguous() for t in feeds.values()])
