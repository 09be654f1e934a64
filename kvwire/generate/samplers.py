"""Samplers: small callables that pick the next token from logits (B, V) -> (B,).

Each is seedable through the `torch.Generator` that `generate(seed=...)` passes in. Temperature is
applied first, then the filter (top-k, top-p, min-p), as transformers does.

Devices: temperature, filters and softmax run where the logits are; the draw itself always runs on
the CPU, from a CPU generator (a (B, V) copy per step off an accelerator, ~1 MB a row for Gemma 3's
262k tokens). Accelerators' generators are other random streams, so drawing there would give other
tokens for the same seed; drawing on the CPU, a seed gives the same tokens on every device wherever
the probabilities agree (they differ in the last bits across devices, which can flip a draw that
lands on a boundary). The tokens come back on the logits' device.
"""
import math
from dataclasses import dataclass

import torch


class Sampler:
    """Base class: `sampler(logits (B, V) float, generator) -> token ids (B,)` on the logits' device;
    `generator` is a CPU `torch.Generator` or None (torch's default CPU generator)."""

    def __call__(self, logits, generator=None):
        raise NotImplementedError

    def sample_rows(self, logits, generators):
        """One token per row of logits (B, V), row i drawn from generators[i] (a CPU generator or
        None): a row's token does not depend on which other rows share the batch (the engine's rows
        each carry their own seed)."""
        return torch.cat([self(logits[i:i + 1], g) for i, g in enumerate(generators)])


def _check_temperature(temperature):
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0 (use kw.Greedy() for 0), got {temperature!r}")


def _draw(logits, generator):
    """One token per row from softmax(logits): drawn on the CPU (see the module docstring)."""
    probs = torch.softmax(logits.float(), dim=-1).to("cpu")
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


def _tempered(logits, temperature):
    """logits / temperature, shifted so each row's maximum is 0: a tiny temperature gives -inf
    (probability 0) to everything below the maximum instead of inf - inf = NaN in the softmax. A
    temperature below float32's smallest normal number (which float32 would round to 0, making the
    maximum 0 / 0 = NaN) divides as that number: the same limit, the greedy choice among ties."""
    logits = logits.float()
    return (logits - logits.max(-1, keepdim=True).values) / max(temperature, torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class Greedy(Sampler):
    """The most likely token."""

    def __call__(self, logits, generator=None):
        return argmax(logits)

    def sample_rows(self, logits, generators):
        return argmax(logits)


def argmax(logits):
    """logits.argmax(-1), the first index on ties and NaN as the largest, as torch's. On CPU float32
    through NumPy's SIMD argmax: torch's runs scalar, ~0.35 ms a row over Gemma 3's 262k-token
    vocabulary against ~0.04 (~2 % of a batch-1 decode step)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


class _Filtered(Sampler):
    """Sampling from softmax(filter(logits / temperature)); subclasses define `filter`."""

    def __post_init__(self):
        _check_temperature(self.temperature)

    def filter(self, logits):
        return logits

    def __call__(self, logits, generator=None):
        return _draw(self.filter(_tempered(logits, self.temperature)), generator)

    def sample_rows(self, logits, generators):
        # the filters run once for the rows; each row then draws from its own generator
        probs = torch.softmax(self.filter(_tempered(logits, self.temperature)), dim=-1).to("cpu")
        rows = [torch.multinomial(probs[i:i + 1], 1, generator=g)[:, 0] for i, g in enumerate(generators)]
        return torch.cat(rows).to(logits.device)


@dataclass(frozen=True)
class Random(_Filtered):
    """Plain sampling from softmax(logits / temperature).

    Example:
        >>> lm.generate("Once", sampler=kw.Random(temperature=0.8), seed=0)
    """

    temperature: float = 1.0


@dataclass(frozen=True)
class TopK(_Filtered):
    """Sample among the k most likely tokens."""

    k: int = 50
    temperature: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {self.k!r}")

    def filter(self, logits):
        k = min(self.k, logits.shape[-1])
        kth = logits.topk(k, dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf"))


@dataclass(frozen=True)
class TopP(_Filtered):
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches p."""

    p: float = 0.9
    temperature: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.p!r}")

    def filter(self, logits):
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= self.p)
        return logits.masked_fill(drop, float("-inf"))


@dataclass(frozen=True)
class MinP(_Filtered):
    """Keep tokens whose probability is at least p times the top token's."""

    p: float = 0.1
    temperature: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.p, (int, float)) or not 0 <= self.p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.p!r}")

    def filter(self, logits):
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < self.p * probs.max(-1, keepdim=True).values, float("-inf"))


@dataclass(frozen=True)
class BeamSearch:
    """Beam search: keep the `num_beams` best partial sequences by summed log-probability.

    A finished hypothesis scores sum_logprobs / generated_length ** length_penalty. With
    early_stopping=True, a row stops once it has num_beams finished hypotheses; with False, when
    the best running beam, scored at its current length, cannot beat the worst finished one; with
    "never", only when no running beam could beat it at any length still allowed (transformers'
    three settings).
    """

    num_beams: int = 3
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        if not isinstance(self.num_beams, int) or isinstance(self.num_beams, bool) or self.num_beams < 1:
            raise ValueError(f"num_beams must be an int >= 1, got {self.num_beams!r}")
        if not (type(self.early_stopping) is bool or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never' (as transformers), "
                             f"got {self.early_stopping!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
