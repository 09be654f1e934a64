"""The one module every exporter sees: the cached graph of the (edited) backbone plus the head,
with flat, named inputs and outputs.

Inputs, in order: `token_ids` (B, T), `positions` (B, T), `cache_index` (), `attention_mask`
(B, max_length), then `past.{i}.key` / `past.{i}.value` for every cached layer i (B, kv_heads,
slots, head_dim) float32, then the graph's runtime inputs (e.g. `steer_strength` (B,)).
Outputs: `logits` (B, 1, V) for the chunk's last position (or (B, T, V) with all_logits), then
`present.{i}.key` / `present.{i}.value`, the next caches.
"""
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.shared import per_call


@dataclass(frozen=True)
class Signature:
    """Names, shapes and dtypes of an exported program's inputs and outputs."""

    inputs: tuple      # (name, shape with "batch"/"chunk" for dynamic dims, dtype)
    outputs: tuple     # names
    max_length: int
    num_layers: int
    runtime_inputs: tuple


class ExportProgram(nn.Module):
    """Flat-input wrapper of `lm.cached` + `lm.head` for torch.export.

    Args:
        lm: a CausalLM (edited or not). max_length: cache timeline length.
        all_logits: return logits for every position of the chunk instead of the last one.
        int_dtype: dtype of integer inputs (torch.int32 for Core ML); cast to int64 inside.
        mask_dtype: dtype of `attention_mask` (torch.bool, or torch.int32 where a runtime has no
            bool inputs or gathers); the layers read nonzero as valid.
    """

    def __init__(self, lm, max_length, all_logits=False, int_dtype=torch.int64, mask_dtype=torch.bool):
        super().__init__()
        cached = lm.cached
        self.body, self.head = cached.graph_module, lm.head
        self.slots = cached.slots
        self.runtime = dict(cached.runtime_inputs)
        self.max_length, self.all_logits = max_length, all_logits
        self.int_dtype, self.mask_dtype = int_dtype, mask_dtype
        self._defaults = cached.default_inputs

    def forward(self, token_ids, positions, cache_index, attention_mask, *rest):
        n = 2 * len(self.slots)
        flat, runtime = rest[:n], rest[n:]
        cache = tuple((flat[2 * i], flat[2 * i + 1]) for i in range(len(self.slots)))
        runtime = [r.long() if self.runtime[name] == torch.int64 else r for name, r in zip(self.runtime, runtime)]
        # the layers gather from the mask as given: bool, or int32 where the runtime needs it
        with per_call():  # one copy of the masks and rotary tables in the exported graph
            hidden, next_cache = self.body(token_ids.long(), positions.long(), cache_index.long(),
                                            attention_mask, cache, *runtime)
        logits = self.head(hidden if self.all_logits else hidden[:, -1:])
        return (logits.float(), *[t for pair in next_cache for t in pair])

    def signature(self):
        inputs = [("token_ids", ("batch", "chunk"), self.int_dtype),
                  ("positions", ("batch", "chunk"), self.int_dtype),
                  ("cache_index", (), self.int_dtype),
                  ("attention_mask", ("batch", self.max_length), self.mask_dtype)]
        outputs = ["logits"]
        for i, slot in enumerate(self.slots):
            k_shape, v_shape = slot.module.cache_spec(1, self.max_length, torch.float32)
            for part, shape in (("key", k_shape), ("value", v_shape)):
                inputs.append((f"past.{i}.{part}", ("batch", *shape[1:]), torch.float32))
                outputs.append(f"present.{i}.{part}")
        for name, dtype in self.runtime.items():
            inputs.append((name, ("batch",), self.int_dtype if dtype == torch.int64 else dtype))
        return Signature(tuple(inputs), tuple(outputs), self.max_length, len(self.slots), tuple(self.runtime))

    def example_inputs(self, batch_size, chunk):
        """Zero/valid example tensors for tracing: (B, chunk) ids at the start of the cache."""
        sizes = {"batch": batch_size, "chunk": chunk}
        out = []
        for name, shape, dtype in self.signature().inputs:
            shape = tuple(sizes.get(d, d) for d in shape)
            if name == "positions":
                out.append(torch.arange(chunk, dtype=dtype).expand(shape).contiguous())
            elif name == "attention_mask" or name.endswith("_strength"):
                out.append(torch.ones(shape, dtype=dtype))
            else:
                out.append(torch.zeros(shape, dtype=dtype))
        return tuple(out)

    def default_runtime_inputs(self):
        """Defaults of the runtime inputs for one row (stored in exported metadata); an input
        whose default is the row's prompt length (a `generated_only` steer) is "prompt_length"."""
        probe = 1 + self.max_length  # a prompt length no constant default can equal
        plain, probed = self._defaults(1), self._defaults(1, torch.tensor([probe]))
        out = {}
        for name, dtype in self.runtime.items():
            follows = int(probed[name][0]) == probe and int(plain[name][0]) != probe
            value = plain[name][0]
            out[name] = "prompt_length" if follows else float(value) if dtype.is_floating_point else int(value)
        return out
