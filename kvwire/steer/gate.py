"""Conditional steering: a linear probe read at one site gates an operation at another, in the
graph (CAST-style, arXiv 2409.05907, per position).

`Probe` turns the hidden state at its site into a gate (B, T, 1) in [0, 1]; the gated operation
(`Steer`, `Ablate`, `Clamp`, ...) is called with it as a second input and acts only as much as the
gate is open. Both are layers of the edited graph, so the cache pass keeps them, rows of one batch
carry their own thresholds (`<name>_threshold`) and exported models take them at run time.

The gate is computed at each position from that position's own state, or, with
`Gate(scope="prompt")`, CAST's prompt-level condition: one decision from the mean of the row's
prompt states, kept for every generated token (`PromptProbe`, a state slot in the cache).
"""
from dataclasses import dataclass

import torch

from ..graph.edit import Edit
from ..layers.attention import functional_cache_writes
from ..layers.base import Layer
from ..layers.masks import per_row as per_row_index
from .layer import as_vector
from .schedule import END, per_row

KINDS = ("dot", "cosine")
SCOPES = ("position", "prompt")


class Probe(Layer):
    """x (B, T, D) -> gate (B, T, 1) float32: open where the probe's score passes its threshold.

    Args:
        direction: (D,) probe weights (`kind="dot"`: score = x . w + bias, a linear probe's logit) or
            a condition vector (`kind="cosine"`: score = cos(x, w)).
        threshold: a number or (B,) tensor; runtime input `<name>_threshold` (B,) float32.
        kind: "dot" or "cosine" (see direction).
        bias: added to a "dot" score.
        sharpness: None: a hard gate (score > threshold); a number k: sigmoid(k * (score - threshold)).
        name: prefix of the runtime input.
        device: where its buffers are kept (default: the direction's).

    Example:
        >>> probe = Probe(torch.randn(640), threshold=0.0)
        >>> probe(torch.randn(1, 3, 640)).shape
        torch.Size([1, 3, 1])
    """

    def __init__(self, direction, threshold=0.0, *, kind="dot", bias=0.0, sharpness=None, name="gate", device=None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"probe kind must be one of {KINDS}, got {kind!r}")
        if sharpness is not None and not float(sharpness) > 0:
            raise ValueError(f"sharpness must be a positive number (or None for a hard gate), got {sharpness!r}")
        direction = as_vector(direction, device, "probe direction")
        if not direction.any():
            raise ValueError("probe direction is all zeros")
        threshold = torch.as_tensor(threshold, dtype=torch.float32, device=direction.device)
        if threshold.dim() > 1 or not torch.isfinite(threshold).all():
            raise ValueError(f"threshold must be a finite number or (B,) tensor, got {threshold.tolist()}")
        self.register_buffer("direction", direction)
        self.register_buffer("threshold", threshold)
        self.kind, self.bias, self.name = kind, float(bias), str(name)
        self.sharpness = None if sharpness is None else float(sharpness)
        self.runtime_inputs = {f"{self.name}_threshold": torch.float32}

    def extra_repr(self):
        return f"kind={self.kind!r}, width={self.direction.numel()}, threshold={self.threshold.tolist()}, " \
               f"sharpness={self.sharpness}, name={self.name!r}"

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        return {f"{self.name}_threshold": per_row(self.threshold, batch_size, "probe threshold")}

    def forward(self, x):
        inputs = {k: v.to(x.device) for k, v in self.runtime_defaults(x.shape[0]).items()}
        return self.forward_cached(x, positions=None, **inputs)

    def forward_cached(self, x, *, positions=None, **inputs):
        return self.gate_of(x, inputs)

    def gate_of(self, x, inputs):
        """x (B, T, D) states -> gate (B, T, 1), with the threshold from `inputs`."""
        xf = x.float()
        score = xf @ self.direction[:, None] + self.bias  # (B, T, 1)
        if self.kind == "cosine":
            score = score / (xf.norm(dim=-1, keepdim=True) * self.direction.norm()).clamp_min(1e-12)
        margin = score - inputs[f"{self.name}_threshold"][:, None, None]
        return (margin > 0).to(torch.float32) if self.sharpness is None else torch.sigmoid(self.sharpness * margin)


class PromptProbe(Probe):
    """A `Probe` read from the mean of each row's prompt states: CAST's condition (arXiv 2409.05907),
    one decision per prompt, a state slot in the cached graph.

    It scores the mean of a row's prompt states at its site instead of each position's own
    state, and generated tokens keep the prompt's decision. The running sum and count of the prompt's
    states outlive a call, so the probe holds a *state slot* in the cached graph: it speaks the cache
    protocol (`cache_spec`, `forward_cached(..., cache)`) with a pair (sum (B, 1, 1, D), count
    (B, 1, 1, 1)) that does not grow with the timeline — a ring of one slot holding the value after the
    row's last token, which is what the engine's copies, growth and prefix store already do right for a
    ring: a stored state is reused only at the length it was stored at.

    Per chunk, branch-free:
    - a row whose chunk holds its first real token (position 0, not a pad) starts from zero (a row the
      engine gives to a new request), any other row from its state;
    - real tokens at positions < `<name>_until` (the row's prompt length; runtime input, default: the
      prompt lengths the engine gives, else no end) add to the sum, in order (a running sum in the chunk);
    - each position's score reads the running mean: a prompt position sees the prompt so far, a
      generated one the whole prompt (CAST reads the whole prompt at once; the running mean is its
      causal form, equal from the prompt's last token on, and what chunked prefill can reproduce).

    x (B, T, D) -> gate (B, T, 1). Runtime inputs: `<name>_threshold` (B,) float32 and
    `<name>_until` (B,) int64 (the first position that is not prompt). Plainly called it treats the
    whole input as prompt (a running mean over every position).

    Example:
        >>> probe = PromptProbe(torch.randn(640), threshold=0.2, kind="cosine")
        >>> probe(torch.randn(1, 5, 640)).shape
        torch.Size([1, 5, 1])
    """

    uses_positions = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime_inputs = {**self.runtime_inputs, f"{self.name}_until": torch.int64}

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        until = torch.full((batch_size,), END, dtype=torch.int64, device=self.threshold.device) \
            if prompt_lengths is None else \
            torch.as_tensor(prompt_lengths, dtype=torch.int64, device=self.threshold.device).reshape(batch_size)
        return {**super().runtime_defaults(batch_size), f"{self.name}_until": until}

    def cache_spec(self, batch_size, max_length, dtype):
        return (batch_size, 1, 1, self.direction.numel()), (batch_size, 1, 1, 1)

    def forward(self, x):
        B, T, _ = x.shape
        inputs = {k: v.to(x.device) for k, v in self.runtime_defaults(B).items()}
        cache = tuple(torch.zeros(s, device=x.device) for s in self.cache_spec(B, T, None))
        positions = torch.arange(T, device=x.device)[None].expand(B, T)
        index = torch.zeros((), dtype=torch.long, device=x.device)
        mask = torch.ones(B, T, dtype=torch.bool, device=x.device)
        return self.forward_cached(x, positions=positions, cache_index=index, attention_mask=mask, cache=cache,
                                   **inputs)[0]

    def forward_cached(self, x, *, positions, cache_index, attention_mask, cache, **inputs):
        """-> (gate (B, T, 1), next state (sum, count)); the state is updated in place in eager calls."""
        total, count = cache
        B, T, D = x.shape
        offsets = torch.arange(T, device=x.device)
        index = cache_index[:, None] + offsets if per_row_index(cache_index) else (cache_index + offsets)[None]
        real = attention_mask.gather(1, index.expand(B, T)).to(torch.float32)  # (B, T): not a pad
        fresh = (real * (positions == 0).to(torch.float32)).amax(dim=1)  # (B,): the row starts here
        keep = (1.0 - fresh)[:, None, None, None]
        until = inputs[f"{self.name}_until"]
        w = (real * (positions < until[:, None]).to(torch.float32))[..., None]  # (B, T, 1)
        sums = (total * keep).view(B, 1, D) + torch.cumsum(w * x.float(), dim=1)  # (B, T, D)
        counts = (count * keep).view(B, 1, 1) + torch.cumsum(w, dim=1)  # (B, T, 1)
        gate = self.gate_of(sums / counts.clamp_min(1.0), inputs)
        new = (sums[:, -1:].view(B, 1, 1, D), counts[:, -1:].view(B, 1, 1, 1))
        if functional_cache_writes():
            return gate, new
        total.copy_(new[0])  # in place, as cached attention writes its keys and values
        count.copy_(new[1])
        return gate, (total, count)


@dataclass
class Gate:
    """Where and how to read a probe that gates a steering operation (`lm.ablate(..., gate=Gate(...))`).

    Args:
        direction: (D,) tensor. layer: the block whose `site` the probe reads; it must come before
            every position the gated operation acts on in the graph (an earlier block, or an earlier
            site of the same block). scope: "position" (each position's own state) or "prompt" (the
            mean of the row's prompt states: one decision per prompt, `PromptProbe`). Other fields:
            see `Probe`.

    Example:
        >>> harmful = kw.Gate(probe_w, layer=6, threshold=0.0)
        >>> safe = lm.steer(refuse_vec, 4.0, gate=harmful)   # refuse_vec: blocks after 6
    """

    direction: object
    layer: int
    site: str = "block_out"
    threshold: object = 0.0
    kind: str = "dot"
    bias: float = 0.0
    sharpness: float = None
    name: str = "gate"
    scope: str = "position"

    def probe(self, device=None):
        if self.scope not in SCOPES:
            raise ValueError(f"gate scope must be one of {SCOPES}, got {self.scope!r}")
        kind = Probe if self.scope == "position" else PromptProbe
        return kind(self.direction, self.threshold, kind=self.kind, bias=self.bias, sharpness=self.sharpness,
                    name=self.name, device=device)


class GatedInsert(Edit):
    """A clone fn: reads `probe` after the call `probe_call` and calls each `targets[call]` layer on
    that call's output with the gate as its second input."""

    def __init__(self, probe_call, probe, targets):
        super().__init__([probe_call, *targets])
        self.probe_call, self.probe, self.targets = probe_call, probe, dict(targets)
        self.gate = None

    def prepare(self, gm, names):
        super().prepare(gm, names)
        self.gate = None  # one rebuild, one gate
        order = [n for n in names if n == self.probe_call or n in self.targets]
        early = order[:order.index(self.probe_call)] if self.probe_call in order else []
        if early:
            raise ValueError(f"the gate's probe at {self.probe_call!r} comes after the gated operation at "
                             f"{early[0]!r}; a probe must be read before what it gates")

    def apply(self, name, layer, *args, **kwargs):
        y = layer(*args, **kwargs)
        if name == self.probe_call:
            self.gate = self.probe(y)
        if name in self.targets:
            y = self.targets[name](y, self.gate)
        return y
