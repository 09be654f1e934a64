"""`Scheduled`: the base of steering operations: which positions of each row an operation touches.

A schedule is one of
- "all": every position (the default);
- "prompt": the prompt's positions only;  "generated": generated tokens only;
- an int k: positions >= k (0 is a row's first prompt token);  a pair (k0, k1): k0 <= position < k1.
In a cached graph it is two (B,) int64 runtime inputs, `<name>_start` and `<name>_end`, so rows of
one batch (and exported models) can each have their own. A plain (uncached) call has no prompt
length: "prompt" and "generated" then cover every position it is given.
"""
import torch

from ..layers.base import Layer
from ..layers.shared import shared

WHEN = ("all", "prompt", "generated")
END = 2**31 - 1  # "no end": fits the int32 positions some runtimes take


def parse_when(when):
    """`when` checked: "all" | "prompt" | "generated" | int k >= 0 | (k0, k1) with 0 <= k0 <= k1."""
    if when is None:
        return "all"
    if isinstance(when, str):
        if when not in WHEN:
            raise ValueError(f"when must be one of {WHEN}, a first position k or a range (k0, k1); got {when!r}")
        return when
    if isinstance(when, bool) or not isinstance(when, (int, tuple, list)):
        raise TypeError(f"when must be one of {WHEN}, an int or a pair of ints; got {type(when).__name__}")
    pair = (when, END) if isinstance(when, int) else tuple(when)
    if len(pair) != 2 or not all(isinstance(k, int) and not isinstance(k, bool) for k in pair) \
            or not 0 <= pair[0] <= pair[1]:
        raise ValueError(f"when as positions must be k >= 0 or (k0, k1) with 0 <= k0 <= k1; got {when!r}")
    return pair


def strength_tensor(strength, device):
    """A number or (B,) tensor as a float32 tensor on `device` (a layer's default strength)."""
    strength = torch.as_tensor(strength, dtype=torch.float32, device=device)
    if strength.dim() > 1:
        raise ValueError(f"strength must be a number or a (B,) tensor, got shape {tuple(strength.shape)}")
    return strength


def schedule_mask(positions, start, end, scale=None):
    """(B, T, 1) float32: 1 where start <= position < end, for positions (B, T) and each row's
    bounds start, end (B,); times `scale` (B,) per row where one is given (a strength)."""
    # a product of two masks, not `&`: Core ML's converter has no logical and
    on = (positions >= start[:, None]).to(torch.float32) * (positions < end[:, None]).to(torch.float32)
    return (on if scale is None else on * scale[:, None]).unsqueeze(-1)


def per_row(value, batch_size, what):
    """A layer's default (a number or (B,) tensor) as (batch_size,), refused naming `what` when its
    rows do not fit the batch."""
    value = value.reshape(-1)
    if value.numel() == 1:
        return value.expand(batch_size).clone()
    if value.numel() != batch_size:
        raise ValueError(f"{what} has {value.numel()} rows but the batch has {batch_size}; "
                         f"give one per prompt or a single number")
    return value.clone()


class Scheduled(Layer):
    """A layer acting on the positions its schedule picks; subclasses define `act(x, on, inputs)`.

    Args:
        name: prefix of its runtime inputs (layers sharing a name share them).
        when: see the module docstring.
    Its defaults are made where its buffers are (subclasses register at least one).

    The mask `act` gets is computed once per cached-graph call for all the layers of one name
    (`kvwire.layers.shared`), times the row's `<name>_<scale_input>` where the class names one
    (its strength), so a layer's own work is its operation alone.
    """

    uses_positions = True
    scale_input = None  # e.g. "strength": the (B,) runtime input the mask is scaled by

    def __init__(self, name, when=None):
        super().__init__()
        self.name = str(name)
        self.when = parse_when(when)

    @property
    def runtime_inputs(self):
        return {**self.own_inputs(), f"{self.name}_start": torch.int64, f"{self.name}_end": torch.int64}

    def own_inputs(self):
        """{name: dtype} of the operation's own runtime inputs (strengths, bounds)."""
        return {}

    def own_defaults(self, batch_size):
        """{name: (batch_size,) tensor}: the defaults of `own_inputs`."""
        return {}

    def act(self, x, on, inputs):
        """x (B, T, D), on (B, T, 1) float32 -> x changed where `on` is not 0. `on` is 1 where the
        schedule picks (times the row's `scale_input` where the class names one, times the gate)."""
        raise NotImplementedError

    def forward(self, x, gate=None):
        """x (B, T, D) -> x with the operation applied at the scheduled positions (no prompt length).
        gate: None, or (B, T, 1) float32 in [0, 1] scaling the operation per position (a `Probe`'s)."""
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        inputs = {k: v.to(x.device) for k, v in self.runtime_defaults(x.shape[0]).items()}
        return self.forward_cached(x, gate, positions=positions, **inputs)

    def forward_cached(self, x, gate=None, *, positions, **inputs):
        name = self.name
        scale = inputs[f"{name}_{self.scale_input}"] if self.scale_input else None
        # once per call for every layer of this name: the graph passes them the same input tensors
        on = shared(schedule_mask, positions, inputs[f"{name}_start"], inputs[f"{name}_end"], scale)
        on = on if gate is None else on * gate
        # several residual streams (B, T, streams, D): each acted on as a token of its own (a static
        # shape: no branch in a traced or exported graph; fx's symbolic trace sees (B, T, D) layers)
        if not isinstance(x, torch.fx.Proxy) and x.dim() > 3:
            B, T = x.shape[:2]
            streams = x[0, 0].numel() // x.shape[-1]
            flat = self.act(x.reshape(B, T * streams, x.shape[-1]), on.repeat_interleave(streams, dim=1), inputs)
            return flat.reshape(x.shape)
        return self.act(x, on, inputs)

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        device = next(self.buffers()).device
        none = torch.zeros(batch_size, dtype=torch.int64, device=device)
        never = torch.full((batch_size,), END, dtype=torch.int64, device=device)
        lengths = None if prompt_lengths is None else \
            torch.as_tensor(prompt_lengths, dtype=torch.int64, device=device).reshape(batch_size)
        if isinstance(self.when, tuple):
            start, end = none + self.when[0], never * 0 + self.when[1]
        elif self.when == "prompt" and lengths is not None:
            start, end = none, lengths
        elif self.when == "generated" and lengths is not None:
            start, end = lengths, never
        else:
            start, end = none, never
        return {**self.own_defaults(batch_size), f"{self.name}_start": start, f"{self.name}_end": end}

    def same_inputs(self, other):
        """Whether `other` reads the same runtime inputs with the same defaults (may share them)."""
        if type(other) is not type(self) or other.name != self.name or other.when != self.when:
            return False
        mine, theirs = self.own_defaults(1), other.own_defaults(1)
        return mine.keys() == theirs.keys() and all(torch.equal(v.cpu(), theirs[k].cpu()) for k, v in mine.items())
