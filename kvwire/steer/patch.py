"""Activation patching (`kw.patch.sweep`, `kw.patch.run`): put the clean prompt's activation at a
(site, block, position) into the corrupted prompt's run and measure how much of the clean answer
comes back.

How a batch is patched: the clean prompt is captured once (`kvwire.steer.capture`) at every
(site, block) asked for. The model is cloned once with a `Patch` layer at each of those sites (after
what is chained there already; inside the call for a site inside one, as `attn_heads`), holding the
clean values lined up with the corrupted prompt's positions (T, D). Every row of a batch is the
corrupted prompt; before a run each `Patch` gets a (B, T) bool mask, the batch of patch rows, and
replaces row r's value at position p by the clean one where the mask is set: one patch per row in a
sweep, any set of patches per row in `run`. Row 0 of every batch patches nothing: the corrupted
prompt beside the patched rows, whose spread from the corrupted prompt run alone is the measured
noise floor (what batching alone moves the metric by).

What rows share is run once: a batch whose patches all sit at block b or above starts from the
corrupted prompt's states at the input of a cut block at or below b (`kvwire.steer.rows.upper_from`;
the states of every cut are read in one run of the corrupted prompt); rows are run in order of
their lowest patched block, so a sweep's batches each hold few blocks. The graph is cut at most at
CUTS evenly spaced blocks: each cut costs a graph clone (~0.1 s for a 30-block model) against
the blocks it saves, which a short sweep does not repay for every block.

Clean and corrupted prompts of different token lengths are refused unless a `position_map`
({corrupted position: clean position}) says which clean position feeds which corrupted one.
"""
from dataclasses import dataclass, replace

import torch

from ..graph import clone, insert_after
from ..graph.sites import put_inside
from ..layers.base import Layer
from .capture import read_sites, site_reads, token_rows
from .patch_checks import metric_of, position_map_of
from .rows import block_starts, given, upper_from
from .turns import turn

CUTS = 4  # the most blocks a Patcher cuts its graph at (the first patched one included, never cut)


class Patch(Layer):
    """`x (B, T, D) -> x` with `x[r, p]` replaced by `values[p]` where `rows[r, p]` (None: identity).

    Example:
        >>> p = Patch(torch.ones(3, 2)); p.rows = torch.tensor([[False, True, False]])
        >>> p(torch.zeros(1, 3, 2))[0, :, 0]
        tensor([0., 1., 0.])
    """

    def __init__(self, values):
        super().__init__()
        self.register_buffer("values", values, persistent=False)  # (T, D)
        self.rows = None  # (B, T) bool, set before each run

    def forward(self, x):
        if self.rows is None:
            return x
        return torch.where(self.rows[..., None], self.values.to(x.dtype), x)


@dataclass(frozen=True)
class PatchResult:
    """What patching measured. `scores`: the metric per patch ((sites, layers, positions) for a
    sweep, (rows,) for `run`); `recovered` = (scores - corrupted) / (clean - corrupted) (1: the clean
    answer is back; 0: no effect); `clean`, `corrupted`: the metric of each prompt run alone; `noise`:
    the largest |metric - corrupted| of the unpatched corrupted rows beside the patched ones, and
    `noise_floor` the same as a fraction recovered; `sites`, `layers`, `positions` (corrupted
    positions): the sweep's axes (None for `run`); `tokens`: the corrupted prompt's token ids."""

    scores: torch.Tensor
    recovered: torch.Tensor
    clean: float
    corrupted: float
    noise: float
    noise_floor: float
    tokens: list
    sites: list = None
    layers: list = None
    positions: list = None

    def to_dict(self):
        return {"logit_diff": self.scores.tolist(), "recovered": self.recovered.tolist(), "clean": self.clean,
                "corrupted": self.corrupted, "noise": self.noise, "noise_floor": self.noise_floor,
                "tokens": self.tokens, "sites": self.sites, "layers": self.layers, "positions": self.positions}


def sweep(lm, clean, corrupted, sites="block_out", positions=None, *, layers=None, answers=None, metric=None,
          position_map=None, batch_size=16):
    """Patch each (site, block, position) of clean into corrupted, one per row, batched.

    Args:
        clean: the prompt whose activations are patched in (a str or a token-id list).
        corrupted: the prompt they are patched into (likewise).
        sites: a site name or a list (`ALL_SITES`).
        layers: block indices (list, "A-B"; None: all).
        positions: corrupted positions (ints, negative from the end); None: every one with a clean
            counterpart.
        answers: (correct, incorrect): token ids, or texts of one token each; the metric is then
            logits[correct] - logits[incorrect] at the corrupted prompt's last position.
        metric: instead of answers, a function of those logits (B, V) float32 -> scores (B,).
        position_map: {corrupted position: clean position} (or a list: entry p for position p, None
            for none); required when the prompts' token lengths differ.
        batch_size: patch rows per run (plus the unpatched row).
    Returns a `PatchResult` whose scores and recovered are (len(sites), len(layers), len(positions)).

    Example:
        >>> lm = kw.load("smollm2-135m-instruct")     # 6 tokens, then 5: "The", " is", " in" line up
        >>> r = kw.patch.sweep(lm, "The Eiffel Tower is in", "The Louvre is in", ["block_out"],
        ...                    answers=(" Paris", " Rome"), position_map={0: 0, 3: 4, 4: 5})
        >>> r.recovered.shape
        torch.Size([1, 30, 3])
    """
    patcher = Patcher(lm, clean, corrupted, sites, layers, answers, metric, position_map)
    return sweep_with(patcher, patcher.positions(positions), batch_size)


def sweep_with(patcher, positions, batch_size=16):
    """`sweep` on a `Patcher` already built, over checked corrupted `positions` (`Patcher.positions`)."""
    rows = [[(s, b, p)] for s in patcher.sites for b in patcher.blocks for p in positions]
    result = patcher.run(rows, batch_size)
    shape = (len(patcher.sites), len(patcher.blocks), len(positions))
    return replace(result, scores=result.scores.reshape(shape), recovered=result.recovered.reshape(shape),
                   sites=patcher.sites, layers=patcher.blocks, positions=positions)


def run(lm, clean, corrupted, patches, *, sites="block_out", layers=None, answers=None, metric=None,
        position_map=None, batch_size=16):
    """Rows of patches: `patches[r]` is a list of (site, block, position) patched together in row r
    (position None: every corrupted position with a clean counterpart). Other arguments as `sweep`;
    `sites` and `layers` name what the patches may use. Returns a `PatchResult` with scores (R,).

    Example:
        >>> everything = [(s, b, None) for s in ("resid_pre", "attn_heads") for b in range(4)]
        >>> kw.patch.run(lm, clean, corrupted, [[], everything], sites=["resid_pre", "attn_heads"],
        ...              answers=(5, 7)).recovered
        tensor([0., 1.])
    """
    return Patcher(lm, clean, corrupted, sites, layers, answers, metric, position_map).run(patches, batch_size)


class Patcher:
    """The patched clone of `lm` for one clean/corrupted pair (see the module docstring).

    share: False runs every row through the whole model (what sharing saves is measured against it
    in bench/patch_sweep.py)."""

    def __init__(self, lm, clean, corrupted, sites, layers, answers, metric, position_map, share=True):
        (self.clean_ids,), (self.ids,) = token_rows(lm, [clean], "clean"), token_rows(lm, [corrupted], "corrupted")
        self.lm, self.map = lm, position_map_of(position_map, len(self.clean_ids), len(self.ids))
        self.metric = metric_of(lm, answers, metric)
        self.sites, self.blocks, reads = site_reads(lm, sites, layers)
        got = read_sites(lm, [self.clean_ids], reads)
        source = torch.tensor([self.map.get(p, 0) for p in range(len(self.ids))])
        self.layers = {key: Patch(got[key][0, source].to(lm.device)) for key in reads}
        graph = {r: key for key, r in reads.items() if isinstance(r, str)}
        fn = insert_after(list(graph), lambda call, layer: self.layers[graph[call]]) if graph else None
        self.module = clone(lm.backbone, fn, depth="layer")
        for key, read in reads.items():
            if not isinstance(read, str):
                put_inside(self.module, key[0], {read[0]: self.layers[key]})
        starts = block_starts(self.module) if share else {}
        step = -(-len(self.blocks) // CUTS)
        # evenly over the patched blocks, the first only where something is below it
        self.starts = {b: starts[b] for b in self.blocks[::step] if b in starts and b > min(starts)}
        self._cuts = {}  # block -> (upper graph from its input, the corrupted prompt's states there)

    def positions(self, positions):
        """Corrupted positions checked: in range (negative from the end) and with a clean counterpart."""
        if positions is None:
            return sorted(self.map)
        positions = [positions] if isinstance(positions, int) else list(positions)
        n, out = len(self.ids), []
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, int) or not -n <= p < n:
                raise ValueError(f"positions must be ints in [-{n}, {n}) (the corrupted prompt has {n} tokens), "
                                 f"got {p!r}")
            if p % n not in self.map:
                raise ValueError(f"corrupted position {p} has no clean position in position_map "
                                 f"{dict(sorted(self.map.items()))}")
            out.append(p % n)
        return out

    def _scores(self, ids, masks, block=None):
        """The metric (B,) of rows `ids` (B, T) patched where `masks` {(site, block): (B, T)} say;
        `block`: no row patches below it (what is below then runs for one row)."""
        cut = self._cut(block)
        if cut is not None:
            states = cut[1]  # the corrupted prompt's states at the cut's input: every row's there
        for key, layer in self.layers.items():
            layer.rows = None if masks is None else masks[key]
        try:
            if cut is None:
                hidden = self.module(ids)
            else:
                with given(states.expand(len(ids), -1, -1)):
                    hidden = cut[0](ids)
            logits = self.lm.head(hidden[:, -1]).float()  # (B, V) at the last position
        finally:
            for layer in self.layers.values():
                layer.rows = None
        return self.metric(logits)

    def _cut(self, block):
        """(upper graph, the corrupted prompt's states (1, T, D) there) of the patched clone cut at
        the input of the highest cut block at or below `block`, or None (none there)."""
        below = [b for b in self.starts if block is not None and b <= block]
        if not below:
            return None
        if not self._cuts:
            self._cuts = {b: [None, states] for b, states in self._cut_states().items()}
        at = max(below)
        if self._cuts[at][0] is None:
            self._cuts[at][0] = upper_from(self.module, self.starts[at])
        return self._cuts[at]

    def _cut_states(self):
        """{cut block: the corrupted prompt's states (1, T, D) at its input}, from one run (no
        Patch set: the corrupted prompt as it is)."""
        seen, hooks = {}, []
        for block, call in self.starts.items():
            def keep(module, args, block=block):
                seen.setdefault(block, args[0])
            hooks.append(self.module.get_submodule(call).register_forward_pre_hook(keep))
        try:
            with torch.inference_mode():
                self.module(torch.tensor([self.ids], device=self.lm.device))
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    def run(self, patches, batch_size=16):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        rows = [self._row(i, row) for i, row in enumerate(patches)]
        device, T = self.lm.device, len(self.ids)
        lowest = [min((block for _, block in row), default=None) for row in rows]
        order = sorted(range(len(rows)), key=lambda i: (lowest[i] is not None, lowest[i] or 0))
        with torch.inference_mode():
            clean = float(self._scores(torch.tensor([self.clean_ids], device=device), None)[0])
            corrupted = float(self._scores(torch.tensor([self.ids], device=device), None)[0])
            scores, unpatched = torch.zeros(len(rows)), []
            for start in range(0, len(rows), batch_size):
                if start:
                    turn()  # others may run between calls (`kvwire.steer.turns`)
                picked = order[start:start + batch_size]
                chunk = [{}] + [rows[i] for i in picked]  # row 0: the unpatched corrupted prompt
                masks = {key: torch.zeros(len(chunk), T, dtype=torch.bool, device=device) for key in self.layers}
                for r, row in enumerate(chunk):
                    for key, where in row.items():
                        masks[key][r, where] = True
                block = min((lowest[i] for i in picked if lowest[i] is not None), default=None)
                got = self._scores(torch.tensor([self.ids] * len(chunk), device=device), masks, block).cpu()
                unpatched.append(got[0])
                scores[picked] = got[1:]
        if clean == corrupted:
            raise ValueError(f"the clean and corrupted prompts give the same metric ({clean}); the fraction "
                             f"recovered is undefined: pick answers (or a metric) they differ on")
        noise = max((abs(float(u) - corrupted) for u in unpatched), default=0.0)
        return PatchResult(scores, (scores - corrupted) / (clean - corrupted), clean, corrupted, noise,
                           noise / abs(clean - corrupted), list(self.ids))

    def _row(self, i, row):
        """{(site, block): [corrupted positions]} of patches[i]."""
        if not isinstance(row, (list, tuple)):
            raise TypeError(f"patches[{i}] must be a list of (site, block, position), got {row!r:.60}")
        out = {}
        for patch in row:
            if not (isinstance(patch, (list, tuple)) and len(patch) == 3):
                raise ValueError(f"patches[{i}] holds {patch!r}; expected (site, block, position)")
            site, block, position = patch
            if (site, block) not in self.layers:
                raise ValueError(f"patches[{i}] patches ({site!r}, {block!r}), which is not among the sites "
                                 f"{self.sites} x layers {self.blocks} this patching was set up for")
            out.setdefault((site, block), []).extend(self.positions(position))
        return out
