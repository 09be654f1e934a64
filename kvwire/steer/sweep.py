"""`sweep`: what a control vector does across strengths — a probe value and a text sample each."""
import math
from dataclasses import dataclass, field

import torch

from .measure import first_ids
from .vector import ControlVector

# the demo's held-out probe (examples/steer_demo.py): neutral prompts and sentiment words, none of
# them in the training pairs of examples/data/{happy,sad}.txt
PROMPTS = ("I think that today is", "When I opened the door, I felt", "The weather this morning was",
           "Honestly, my week has been", "Looking at the letter, she felt")
HAPPY = (" happy", " wonderful", " great", " joy", " love", " beautiful", " excited", " amazing")
SAD = (" sad", " terrible", " awful", " angry", " miserable", " lonely", " horrible", " upset")


class WordGap:
    """A probe: mean log p(positive word) - mean log p(negative word) as the next token after each
    prompt (each word's first token; give words with their leading space), averaged over prompts.

    Example:
        >>> WordGap([" happy", " glad"], [" sad", " upset"], prompts=["I feel"])(lm.steer(vec, 1.0))
        2.31
    """

    def __init__(self, positive=HAPPY, negative=SAD, prompts=PROMPTS):
        for what, items in (("positive", positive), ("negative", negative), ("prompts", prompts)):
            if isinstance(items, str) or not items or not all(isinstance(t, str) and t for t in items):
                raise ValueError(f"WordGap {what} must be a non-empty list of non-empty str, got {items!r:.60}")
        self.positive, self.negative, self.prompts = tuple(positive), tuple(negative), tuple(prompts)
        self.name = f"log p({_short(self.positive)}) - log p({_short(self.negative)})"

    def __call__(self, lm):
        pos, neg = first_ids(lm, self.positive), first_ids(lm, self.negative)
        gap = 0.0
        with torch.inference_mode():
            for prompt in self.prompts:
                ids = torch.tensor([lm.tokenizer.encode(prompt)], device=lm.device)
                lm.check_uncached_input(ids)
                # the head at the last position only: lm(ids)[0, -1], without the other positions' logits
                logp = torch.log_softmax(lm.head(lm.backbone(ids)[:, -1:])[0, -1].float(), -1)
                gap += float(logp[pos].mean() - logp[neg].mean())
        return gap / len(self.prompts)


@dataclass
class Sweep:
    """`sweep`'s result: per strength the probe's value and a sample continuation of `prompt`."""

    strengths: list
    values: list
    samples: list
    probe: str
    prompt: str
    vector_layers: list = field(default_factory=list)

    def to_dict(self):
        """JSON-ready (a non-finite value becomes None)."""
        return {"strengths": self.strengths, "values": [v if math.isfinite(v) else None for v in self.values],
                "samples": self.samples, "probe": self.probe, "prompt": self.prompt, "layers": self.vector_layers}

    def __str__(self):
        rows = [f"| strength | {self.probe} | sample: {self.prompt!r} |", "|---:|---:|---|"]
        rows += [f"| {s:+.2f} | {v:+.3f} | {t!r} |" for s, v, t in zip(self.strengths, self.values, self.samples)]
        return "\n".join(rows)

    def plot(self, path, title=None):
        """Draw the probe against strength over a table of the samples (matplotlib) into `path`
        (.png, .svg, .pdf)."""
        from .sweep_plot import plot_sweep
        plot_sweep(self, path, title)


def sweep(lm, vector, strengths, probe=None, prompt="I think that today is", max_new_tokens=24, sampler=None):
    """Steer `lm` with `vector` at each strength; measure `probe` and sample a continuation.

    Args:
        lm: a CausalLM with a tokenizer.
        vector: a kw.ControlVector.
        strengths: numbers (e.g. [-1, -0.5, 0, 0.5, 1]), kept in the given order.
        probe: a callable steered_lm -> float; default `WordGap()` (happy vs sad words, the demo's).
        prompt: the sample's prompt.
        max_new_tokens: the sample's budget.
        sampler: the sample's sampler (default greedy).
    Returns a `Sweep`.

    Example:
        >>> result = kw.steer.sweep(lm, kw.ControlVector.load("happy.gguf"), [-1, 0, 1])
        >>> result.values        # rises with the strength for a happy vector
        >>> result.plot("sweep.png")
    """
    if not isinstance(vector, ControlVector):
        raise TypeError(f"sweep expects a kw.ControlVector, got {type(vector).__name__}")
    if isinstance(strengths, (str, bytes)) or not hasattr(strengths, "__iter__"):
        raise TypeError(f"strengths must be a list of numbers, got {strengths!r:.60}")
    strengths = list(strengths)
    if not strengths:
        raise ValueError("strengths is empty; expected numbers such as [-1, 0, 1]")
    for s in strengths:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ValueError(f"strengths must be finite numbers, got {s!r} in {strengths!r:.80}")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty str, got {prompt!r:.60}")
    probe = WordGap() if probe is None else probe
    values, samples = [], []
    for s in strengths:
        steered = lm.steer(vector, float(s))
        with torch.inference_mode():
            values.append(float(probe(steered)))
        samples.append(steered.generate(prompt, max_new_tokens=max_new_tokens, sampler=sampler))
    name = getattr(probe, "name", None) or getattr(probe, "__name__", None) or type(probe).__name__
    return Sweep([float(s) for s in strengths], values, samples, str(name), prompt, vector.layers)


def _short(words):
    return ",".join(w.strip() for w in words[:2]) + (",…" if len(words) > 2 else "")
