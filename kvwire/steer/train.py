"""What `ControlVector.train` computes: prompts' hidden states at a site, and a direction from them.

States come in pairs: rows 0..n-1 are the positive prompts, rows n..2n-1 their negatives, and
d_i = pos_i - neg_i. Every method's direction v points to the positive side and is scaled so that
strength 1 moves a state by the mean separation along it: v = u * mean(d_i . u), u a unit vector.
"""
import torch
from tqdm.auto import tqdm

from ..generate.session import left_pad
from ..graph import clone, tap, with_cache
from ..graph.sites import put_inside
from ..layers.inner import Record

METHODS = ("pca_diff", "pca_center", "mean_diff", "caa", "logistic")
LOGISTIC_L2 = 1e-2  # ridge on the probe weight (states scaled to unit RMS): separable data stay finite
LOGISTIC_STEPS = 200


def check_positions(positions):
    """`positions` as given, refused unless "last", "mean" or a negative int."""
    if (isinstance(positions, str) and positions in ("last", "mean")) or \
            (isinstance(positions, int) and not isinstance(positions, bool) and positions < 0):
        return positions
    raise ValueError(f"positions must be 'last', 'mean' or a negative token index such as -2, got {positions!r}")


def prompt_states(lm, texts, calls, positions="last", batch_size=8, progress=True, depth="layer", inner=None):
    """What the named calls output for each text: {call: (len(texts), D)} float32.

    Args:
        calls: dotted call names of `lm.backbone` traced at `depth`: at "layer", `site_calls` values
            or an inserted layer's name; at "block", block names (`kw.block_calls`).
        inner: {name: (call, site)}: states at sites inside one-call layers (`inner_calls`), read by
            a `Record` put there and returned under `name` as well.
        positions: which tokens: "last" (the last token), "mean" (mean over the prompt's tokens,
            BOS included when the tokenizer adds one) or -k (the k-th token from the end).
    Runs the tapped backbone's cached graph on left-padded batches (pads masked out).

    Example:
        >>> prompt_states(lm, ["Hi", "Bye"], ["layers.2.attn_out"])["layers.2.attn_out"].shape
        torch.Size([2, 640])
    """
    check_positions(positions)
    module, records = lm.backbone, {}
    if inner:
        module = clone(lm.backbone, depth=depth)
        for name, (call, site) in inner.items():
            records[name] = Record()
            put_inside(module, site, {call: records[name]})
    cached = with_cache(tap(module, calls, depth=depth) if calls else module)
    out = {name: [] for name in [*calls, *records]}
    batches = range(0, len(texts), batch_size)
    with torch.inference_mode():
        for start in tqdm(batches, desc="reading hidden states", disable=not progress, leave=False):
            rows = [lm.encode(t) for t in texts[start:start + batch_size]]
            for text, row in zip(texts[start:start + batch_size], rows):
                lm.check_length(len(row), f"prompt {text!r:.40}")
                if isinstance(positions, int) and -positions > len(row):
                    raise ValueError(f"positions={positions} but prompt {text!r:.40} has {len(row)} tokens")
            ids, pos, pads = left_pad(rows, device=lm.device)
            cache = cached.init_cache(len(rows), ids.shape[1])
            mask = torch.arange(ids.shape[1], device=lm.device)[None] >= pads[:, None]  # (B, T)
            result, _ = cached(ids, pos, 0, mask, cache)
            taps = {**(result[1] if calls else {}), **{name: r.seen for name, r in records.items()}}
            for name in out:
                out[name].append(_pick(taps[name].float(), mask, positions))
    return {name: torch.cat(parts) for name, parts in out.items()}


def _pick(states, mask, positions):
    """(B, D) from (B, T, D) left-padded states."""
    if positions == "mean":
        return (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return states[:, -1 if positions == "last" else positions]


def check_caa_pairs(lm, positive, negative, positions):
    """CAA's data: positive[i] and negative[i] are one multiple-choice prompt ending in two different
    answer letters ("...\\nAnswer: (A" and "...\\nAnswer: (B"), which tokenise alike but for the last token."""
    if positions != "last":
        raise ValueError(f"method 'caa' reads the answer letter, the last token: positions must be 'last', "
                         f"got {positions!r}")
    for i, (p, q) in enumerate(zip(positive, negative)):
        if not (p[:-1] == q[:-1] and p[-1] != q[-1] and p[-1].isupper() and q[-1].isupper()):
            raise ValueError(f"method 'caa' expects pairs that end in different answer letters after the same "
                             f"prompt (e.g. '... (A' and '... (B'); pair {i} is {p[-30:]!r} and {q[-30:]!r}")
        a, b = lm.encode(p), lm.encode(q)
        if len(a) != len(b) or a[:-1] != b[:-1]:
            raise ValueError(f"method 'caa': pair {i}'s answer letters are not one last token each "
                             f"({len(a)} and {len(b)} tokens; prompt ...{p[-30:]!r}); end the prompt so the "
                             f"letter stands alone (e.g. with '(')")


def direction(states, n, method, where):
    """The direction (D,) float32 of one block from its states (2n, D): positives first, then negatives.

    `where` names the block in errors. Methods:
    - "pca_center": first principal axis of the d_i, their mean kept (llama.cpp's cvector-generator,
      repeng's "pca_center"); "pca_diff": the same after removing their mean (repeng's default);
    - "mean_diff", "caa": the mean of the d_i (CAA reads them at the answer token);
    - "logistic": the normal of an L2-regularised logistic-regression probe separating the 2n states.
    """
    diffs = (states[:n] - states[n:]).double()
    scale = states.abs().max().double()  # what "zero" means: relative to the states themselves
    if not torch.isfinite(scale):
        raise ValueError(f"hidden states at {where} are not finite; cannot train a direction")
    # a principal axis of fewer than two distinct differences (pca_diff) or of all-zero ones is not a
    # direction of the data, only an artefact of the decomposition (same-text rows of one batch can
    # differ in the last bits, hence a relative tolerance)
    centered = diffs - diffs.mean(0) if method == "pca_diff" else diffs
    if centered.abs().max() <= 1e-5 * float(scale):  # float32 states: equal up to rounding
        what = "the pairs' differences are all equal (one pair, or identical pairs)" if method == "pca_diff" \
            else "positive and negative prompts give the same hidden states"
        raise ValueError(f"cannot train a {method} direction at {where}: {what}; give at least two "
                         f"pairs that differ" + ("" if method != "pca_diff" else " (or use method='mean_diff')"))
    if method in ("mean_diff", "caa"):
        return diffs.mean(0).float()
    axis = _probe(states.double(), n) if method == "logistic" else \
        torch.linalg.svd(centered, full_matrices=False).Vh[0]
    return (axis * (diffs @ axis).mean()).float()


def _probe(states, n):
    """Unit normal (D,) of a logistic-regression probe: positives (label 1) against negatives (0).

    Fit by L-BFGS on the states centered and divided by one number (their RMS): the penalty is the
    same in every direction of the stream, so 2n < D states, separable along many directions, give
    the one of widest margin rather than one that leans on a few quiet features."""
    with torch.inference_mode(False), torch.enable_grad():  # whatever mode the caller trains in
        states = states.clone()  # a normal tensor (states read under inference mode are not)
        x = states - states.mean(0)
        x = x / x.square().mean().sqrt()  # (2n, D); not all zero (checked before)
        on = dict(dtype=torch.float64, device=x.device)  # not the default device
        y = torch.cat([torch.ones(n, **on), torch.zeros(n, **on)])
        w = torch.zeros(x.shape[1], **on, requires_grad=True)
        b = torch.zeros((), **on, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=LOGISTIC_STEPS, tolerance_grad=1e-9, tolerance_change=1e-12,
                                line_search_fn="strong_wolfe")

        def loss():
            opt.zero_grad()
            fit = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y)
            value = fit + LOGISTIC_L2 / 2 * w.square().sum()
            value.backward()
            return value

        opt.step(loss)
    return w.detach() / w.detach().norm()
