"""`ControlVector`: one direction per decoder block, trained from contrastive prompt pairs, with
what it is for (added, ablated or clamped, at which block site) and the model it was trained on."""
import math
from dataclasses import dataclass, field

import torch

from ..graph import numbered_blocks, site_calls
from ..graph.sites import inner_calls
from ..graph.edit import summarize_indices
from ..layers.site import ALL_SITES as SITES
from .fingerprint import fingerprint as model_fingerprint
from .gguf_io import OPERATIONS, load_control_vector, save_control_vector
from .train import METHODS, check_caa_pairs, check_positions, direction, prompt_states

DEFAULT_METHOD = "pca_center"  # what train, `kvwire steer train` and the playground use unless told


@dataclass(eq=False)
class ControlVector:
    """Directions for decoder blocks: {block index: (D,) float32 tensor}, and what they are for.

    Block indices are 0-based and equal llama.cpp's control-vector numbering (`direction.N` is
    added to the output of block N). `model_hint` is the model family ("gemma3", "gpt2").
    `operation`: "add" (`lm.steer`), "ablate" (`lm.ablate`) or "clamp" (`lm.clamp`); `site`: where in
    each block (`kvwire.layers.site.SITES`); `fingerprint`: the training model's
    (`kvwire.steer.fingerprint`), checked when the vector is used; None: unknown (a llama.cpp file).
    `strength`: the recommended strength (`kw.steer.calibrate` sets it), which `lm.steer(vec)` and
    `lm.ablate(vec)` apply when given none and `lm.clamp(vec)` holds the projection at when given no
    bounds; None: none recommended (1 for steer and ablate). Saved with the vector; arithmetic on a
    vector drops it.

    Example:
        >>> vec = kw.ControlVector.train(lm, positive=["I am happy"], negative=["I am sad"])
        >>> happy = lm.steer(vec, 4.0)
        >>> vec.save("happy.gguf"); vec = kw.ControlVector.load("happy.gguf")
    """

    directions: dict
    model_hint: str = ""
    method: str = field(default="", compare=False)
    operation: str = "add"
    site: str = "block_out"
    fingerprint: dict = None
    strength: float = None

    def __post_init__(self):
        if not self.directions:
            raise ValueError("a control vector needs at least one direction")
        widths = {int(v.numel()) for v in self.directions.values()}
        if len(widths) != 1 or any(v.dim() != 1 for v in self.directions.values()):
            raise ValueError(f"directions must be 1-D and of one width; got shapes "
                             f"{[tuple(v.shape) for v in self.directions.values()]}")
        if self.operation not in OPERATIONS:
            raise ValueError(f"operation must be one of {OPERATIONS}, got {self.operation!r}")
        if self.site not in SITES:
            raise ValueError(f"site must be one of {SITES}, got {self.site!r}")
        # kept on the CPU whatever device trained them (small; saved, compared and combined there):
        # `lm.steer` puts them on the model's device
        self.directions = {int(i): v.detach().to(device="cpu", dtype=torch.float32)
                           for i, v in sorted(self.directions.items())}
        self.fingerprint = dict(self.fingerprint) if self.fingerprint else None
        if self.strength is not None:
            if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) \
                    or not math.isfinite(self.strength):
                raise ValueError(f"strength must be a finite number or None (the recommended strength), got "
                                 f"{self.strength!r}")
            self.strength = float(self.strength)

    def __eq__(self, other):
        """Same blocks, bit-equal directions, the same model hint, operation, site and fingerprint
        (the training method aside)."""
        return isinstance(other, ControlVector) and self._meta() == other._meta() \
            and self.layers == other.layers \
            and all(torch.equal(v, other.directions[i]) for i, v in self.directions.items())

    def _meta(self):
        return self.model_hint, self.operation, self.site, self.fingerprint

    @property
    def layers(self):
        return list(self.directions)

    @property
    def width(self):
        return next(iter(self.directions.values())).numel()

    def __neg__(self):
        return self * -1.0

    def __mul__(self, k):
        return ControlVector({i: v * float(k) for i, v in self.directions.items()}, self.model_hint, self.method,
                             self.operation, self.site, self.fingerprint)

    __rmul__ = __mul__

    @classmethod
    def train(cls, lm, positive, negative, layers=None, method=DEFAULT_METHOD, batch_size=8, progress=True, *,
              site="block_out", positions="last", operation="add"):
        """Train from paired prompts: positive[i] and negative[i] differ in the concept only.

        Each prompt's state at `site` of every chosen block, at `positions`, is read in a batched,
        left-padded cached run. Per block, with d_i = pos_i - neg_i (see `kvwire.steer.train`):
        - "pca_center": first principal axis of the d_i without removing their mean (llama.cpp's
          cvector-generator; repeng's "pca_center");
        - "pca_diff": first principal axis of the d_i after removing their mean (repeng's default);
        - "mean_diff": the mean of the d_i (with positions=-k at a post-instruction token, the
          refusal direction of Arditi et al. 2024);
        - "caa": Contrastive Activation Addition (Rimsky et al. 2024): the mean of the d_i at the
          answer letter. positive[i] and negative[i] are the same A/B multiple-choice prompt ending
          in the answer that shows the behaviour and in the one that does not ("...Answer: (A" and
          "...Answer: (B"; which letter is which may vary by pair); the letter must be the last token;
        - "logistic": the normal u of an L2-regularised logistic-regression probe that tells the 2n
          states apart (positives vs negatives).
        Every direction is u * mean(d_i . u), u its unit vector: it points to the positive side and
        strength 1 moves a state by the mean separation along u. Same data, same vector.

        Args:
            lm: a CausalLM with a tokenizer. positive, negative: equal-length non-empty lists of str.
            layers: block indices: None (blocks 1..n-1: llama.cpp cannot store block 0), an int list
                or range, or a string "A-B" (inclusive).
            method: one of METHODS. batch_size: prompts per forward. progress: show a tqdm bar.
            site: where in each block the states are read and the vector acts (`SITES`).
            positions: which tokens: "last", "mean" (over the prompt's tokens) or -k (the k-th last).
            operation: what the vector is for: "add" (`lm.steer`), "ablate" or "clamp".
        Returns a ControlVector recording method, site, operation and the model's fingerprint.

        Example:
            >>> refusal = kw.ControlVector.train(lm, harmful, harmless, method="mean_diff", positions=-1,
            ...                                  operation="ablate")
            >>> compliant = lm.ablate(refusal)
        """
        _check_pairs(positive, negative)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        check_positions(positions)
        if method == "caa":
            check_caa_pairs(lm, positive, negative, positions)
        chosen = parse_layers(layers, numbered_blocks(lm.backbone))
        inside = inner_calls(lm.backbone, site, chosen)  # sites inside one-call layers: read by a Record
        calls = {i: f"{call}:{site}" for i, call in inside.items()} or site_calls(lm.backbone, site, chosen)
        states = prompt_states(lm, list(positive) + list(negative), [] if inside else list(calls.values()), positions,
                               batch_size, progress, inner={calls[i]: (call, site) for i, call in inside.items()})
        n = len(positive)
        where = (lambda i: f"block {i}") if site == "block_out" else (lambda i: f"{site} of block {i}")
        directions = {i: direction(states[call], n, method, where(i)) for i, call in calls.items()}
        return cls(directions, _family(lm), method, operation, site, model_fingerprint(lm))

    def save(self, path):
        """Write a GGUF control vector (see `kvwire.steer.gguf_io`): llama.cpp's format, plus kvwire's
        keys for operation, site, method, fingerprint and the recommended strength."""
        save_control_vector(self.directions, self.model_hint, path, operation=self.operation, site=self.site,
                            method=self.method, fingerprint=self.fingerprint, strength=self.strength)

    @classmethod
    def load(cls, path):
        """Read a GGUF control vector (written by kvwire, llama.cpp's generator or repeng); a file
        without kvwire's keys is added at block_out and has no fingerprint."""
        f = load_control_vector(path)
        return cls(f["directions"], f["model_hint"], f["method"], f["operation"], f["site"], f["fingerprint"],
                   f["strength"])


def parse_layers(layers, blocks):
    """Block indices from None / "A-B" / ints, checked against `blocks` (the indices a model has,
    e.g. `numbered_blocks(backbone)`, or a count n meaning 0..n-1). None means every block but 0
    (llama.cpp cannot store block 0); a range skips nothing silently: each index must exist."""
    have = sorted(range(blocks) if isinstance(blocks, int) else blocks)
    if layers is None:
        chosen = [i for i in have if i > 0] or have[:1]
    elif isinstance(layers, str):
        lo, sep, hi = layers.partition("-")
        if not (lo.strip().isdigit() and (not sep or hi.strip().isdigit())):
            raise ValueError(f"layers string must be 'A-B' or 'A' with block indices, got {layers!r}")
        chosen = list(range(int(lo), int(hi if sep else lo) + 1))
    else:
        chosen = [int(i) for i in layers]
    if not chosen:
        raise ValueError(f"no layers chosen from {layers!r}")
    bad = [i for i in chosen if i not in have]
    if bad:
        raise ValueError(f"layer indices {bad} are not blocks of this model: it has blocks "
                         f"{summarize_indices(have) or 'none'}")
    return sorted(set(chosen))


def last_token_states(lm, texts, names, batch_size=8, progress=True):
    """Block outputs at each text's last token: {block name: (len(texts), D)} float32 (`prompt_states`
    of block names)."""
    return prompt_states(lm, texts, names, "last", batch_size, progress, depth="block")


def _check_pairs(positive, negative):
    for name, items in (("positive", positive), ("negative", negative)):
        if isinstance(items, str) or not isinstance(items, (list, tuple)) or not items:
            raise ValueError(f"{name} must be a non-empty list of str, got {items!r:.60}")
        if not all(isinstance(t, str) and t for t in items):
            raise ValueError(f"{name} must contain only non-empty str")
    if len(positive) != len(negative):
        raise ValueError(f"positive and negative must pair up: got {len(positive)} positive and "
                         f"{len(negative)} negative prompts")


def _family(lm):
    """The model's GGUF architecture name (llama.cpp's model hint), or ""."""
    from ..models.registry import FAMILIES
    family = FAMILIES.get(getattr(lm, "family", None))
    if family is None:  # a CausalLM built by hand: its config's class, when only one family has it
        matches = [f for f in FAMILIES.values() if isinstance(lm.config, f.config_cls)]
        family = matches[0] if len(matches) == 1 else None
    return (family.gguf_architecture or "") if family is not None else ""
