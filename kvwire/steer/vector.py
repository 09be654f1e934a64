"""`ControlVector`: one direction per decoder block, trained from contrastive prompt pairs."""
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..generate.session import left_pad
from ..graph import numbered_blocks, tap, with_cache
from ..graph.edit import summarize_indices
from .gguf_io import load_control_vector, save_control_vector

METHODS = ("pca_diff", "pca_center", "mean_diff")
DEFAULT_METHOD = "pca_center"  # what train, `kvwire steer train` and the playground use unless told


@dataclass(eq=False)
class ControlVector:
    """Directions to add after decoder blocks: {block index: (D,) float32 tensor}.

    Block indices are 0-based and equal llama.cpp's control-vector numbering (`direction.N` is
    added to the output of block N). `model_hint` is the model family ("gemma3", "gpt2").

    Example:
        >>> vec = kw.ControlVector.train(lm, positive=["I am happy"], negative=["I am sad"])
        >>> happy = lm.steer(vec, 4.0)
        >>> vec.save("happy.gguf"); vec = kw.ControlVector.load("happy.gguf")
    """

    directions: dict
    model_hint: str = ""
    method: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.directions:
            raise ValueError("a control vector needs at least one direction")
        widths = {int(v.numel()) for v in self.directions.values()}
        if len(widths) != 1 or any(v.dim() != 1 for v in self.directions.values()):
            raise ValueError(f"directions must be 1-D and of one width; got shapes "
                             f"{[tuple(v.shape) for v in self.directions.values()]}")
        # kept on the CPU whatever device trained them (small; saved, compared and combined there):
        # `lm.steer` puts them on the model's device
        self.directions = {int(i): v.detach().to(device="cpu", dtype=torch.float32)
                           for i, v in sorted(self.directions.items())}

    def __eq__(self, other):
        """Same blocks, bit-equal directions and the same model hint (the training method aside)."""
        return isinstance(other, ControlVector) and self.model_hint == other.model_hint \
            and self.layers == other.layers \
            and all(torch.equal(v, other.directions[i]) for i, v in self.directions.items())

    @property
    def layers(self):
        return list(self.directions)

    @property
    def width(self):
        return next(iter(self.directions.values())).numel()

    def __neg__(self):
        return self * -1.0

    def __mul__(self, k):
        return ControlVector({i: v * float(k) for i, v in self.directions.items()}, self.model_hint, self.method)

    __rmul__ = __mul__

    @classmethod
    def train(cls, lm, positive, negative, layers=None, method=DEFAULT_METHOD, batch_size=8, progress=True):
        """Train from paired prompts: positive[i] and negative[i] differ in the concept only.

        Each prompt's hidden state after every chosen block, at its last token, is read in a
        batched, left-padded cached run. Per block, with d_i = pos_i - neg_i:
        - "pca_center": first principal axis of the pairs centered on their means, i.e. of the
          d_i without removing their mean (llama.cpp's cvector-generator; repeng's "pca_center");
        - "pca_diff": first principal axis of the d_i after removing their mean (repeng's default,
          via scikit-learn PCA);
        - "mean_diff": the mean of the d_i.
        A principal axis u is scaled by mean(d_i . u): the sign then points to the positive side
        whatever sign the decomposition gave, and strength 1 moves a state by the mean separation
        along u. Same data, same vector.

        Args:
            lm: a CausalLM with a tokenizer. positive, negative: equal-length non-empty lists of str.
            layers: block indices: None (blocks 1..n-1: llama.cpp cannot store block 0), an int list
                or range, or a string "A-B" (inclusive).
            method: one of METHODS. batch_size: prompts per forward. progress: show a tqdm bar.
        Returns a ControlVector.
        """
        _check_pairs(positive, negative)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        blocks = numbered_blocks(lm.backbone)
        chosen = parse_layers(layers, blocks)
        names = [blocks[i] for i in chosen]
        states = last_token_states(lm, list(positive) + list(negative), names, batch_size, progress)
        n = len(positive)
        directions = {i: _direction(states[name], n, method, i) for i, name in zip(chosen, names)}
        return cls(directions, _family(lm), method)

    def save(self, path):
        """Write llama.cpp's GGUF control-vector format (see `kvwire.steer.gguf_io`)."""
        save_control_vector(self.directions, self.model_hint, path)

    @classmethod
    def load(cls, path):
        """Read a GGUF control vector (written by kvwire, llama.cpp's generator or repeng)."""
        directions, model_hint = load_control_vector(path)
        return cls(directions, model_hint, "")


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
    """Hidden states after the named calls at each text's last token: {name: (len(texts), D)} float32.

    Runs the tapped backbone's cached graph on left-padded batches (pads masked out).
    """
    cached = with_cache(tap(lm.backbone, names))
    out = {name: [] for name in names}
    batches = range(0, len(texts), batch_size)
    with torch.inference_mode():
        for start in tqdm(batches, desc="reading hidden states", disable=not progress, leave=False):
            rows = [lm.encode(t) for t in texts[start:start + batch_size]]
            for text, row in zip(texts[start:start + batch_size], rows):
                lm.check_length(len(row), f"prompt {text!r:.40}")
            ids, positions, pads = left_pad(rows, device=lm.device)
            cache = cached.init_cache(len(rows), ids.shape[1])
            mask = torch.arange(ids.shape[1], device=lm.device)[None] >= pads[:, None]
            (_, taps), _ = cached(ids, positions, 0, mask, cache)
            for name in names:
                out[name].append(taps[name][:, -1].float())
    return {name: torch.cat(parts) for name, parts in out.items()}


def _direction(states, n, method, block):
    """The direction of one block from its states (2n, D): positives first, then their negatives."""
    diffs = (states[:n] - states[n:]).double()
    scale = states.abs().max().double()  # what "zero" means: relative to the states themselves
    if not torch.isfinite(scale):
        raise ValueError(f"hidden states after block {block} are not finite; cannot train a direction")
    # a principal axis of fewer than two distinct differences (pca_diff) or of all-zero ones is not a
    # direction of the data, only an artefact of the decomposition (same-text rows of one batch can
    # differ in the last bits, hence a relative tolerance)
    centered = diffs - diffs.mean(0) if method == "pca_diff" else diffs
    if centered.abs().max() <= 1e-5 * float(scale):  # float32 states: equal up to rounding
        what = "the pairs' differences are all equal (one pair, or identical pairs)" if method == "pca_diff" \
            else "positive and negative prompts give the same hidden states"
        raise ValueError(f"cannot train a {method} direction at block {block}: {what}; give at least two "
                         f"pairs that differ" + ("" if method != "pca_diff" else " (or use method='mean_diff')"))
    if method == "mean_diff":
        return diffs.mean(0).float()
    axis = torch.linalg.svd(centered, full_matrices=False).Vh[0]
    return (axis * (diffs @ axis).mean()).float()


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
