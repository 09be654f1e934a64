"""Steering operations besides addition, as branch-free layers with per-row runtime inputs:
`Ablate` (project a direction, or a subspace, out) and `Clamp` (hold the projection on a direction
to a value or a range). Like `Steer`, each follows a schedule (`kvwire.steer.schedule`)."""
import torch

from .layer import as_vector
from .schedule import Scheduled, per_row, strength_tensor

LIMIT = float(torch.finfo(torch.float32).max)  # "unbounded" clamp side, finite for every runtime


def as_directions(directions, device, what="directions"):
    """(K, D) float32 from a (D,) or (K, D) tensor or list, checked where it was given (finite,
    non-zero rows), on `device` (None: where it was given)."""
    t = directions if isinstance(directions, torch.Tensor) else torch.as_tensor(directions, dtype=torch.float32,
                                                                                 device="cpu")
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[0] == 0:
        raise ValueError(f"{what} must be (D,) or (K, D) with K >= 1, got shape {tuple(t.shape)}")
    rows = torch.stack([as_vector(row, None, what) for row in t])
    if rows.device.type != "meta":
        norms = rows.norm(dim=1)
        if (norms == 0).any():
            raise ValueError(f"{what} row {int((norms == 0).nonzero()[0])} is all zeros; it has no direction")
    return rows if device is None else rows.to(device)


class Ablate(Scheduled):
    """Removes `strength` times the part of x in the span of `directions`:
    x - s * Q^T Q x, with Q an orthonormal basis of the span (s = 1: directional ablation,
    arXiv 2406.11717; 0: untouched).

    Args:
        directions: (D,) or (K, D); linearly independent rows (the span is what is removed).
        strength: a number or a (B,) tensor (one per row).
        name: runtime-input prefix, as `Steer`.
        device: as `Steer`.
        when: the positions it acts on, as `Steer`.

    Runtime inputs: `<name>_strength` (B,) float32, `<name>_start`, `<name>_end` (B,) int64.

    Example:
        >>> ablate = Ablate(torch.randn(640))
        >>> (ablate(torch.randn(1, 3, 640)) @ ablate.basis.T).abs().max() < 1e-4
        tensor(True)
    """

    def __init__(self, directions, strength=1.0, name="ablate", device=None, when=None):
        super().__init__(name, when)
        rows = as_directions(directions, None)
        device = rows.device if device is None else torch.device(device)
        if rows.device.type == "meta":  # a model being moved to meta: shapes only
            basis = rows
        else:
            q, r = torch.linalg.qr(rows.double().T)  # (D, K): orthonormal columns spanning the rows
            small = r.diagonal().abs() <= 1e-6 * r.diagonal().abs().max()
            if small.any():
                raise ValueError(f"directions row {int(small.nonzero()[0])} lies in the span of the rows before it; "
                                 f"give linearly independent directions")
            basis = q.T.float()
        self.register_buffer("basis", basis.contiguous().to(device))  # (K, D)
        self.register_buffer("strength", strength_tensor(strength, device))

    def extra_repr(self):
        return f"directions={self.basis.shape[0]}, width={self.basis.shape[1]}, " \
               f"strength={self.strength.tolist()}, when={self.when!r}, name={self.name!r}"

    scale_input = "strength"  # `on` comes scaled by each row's strength

    def own_inputs(self):
        return {f"{self.name}_strength": torch.float32}

    def own_defaults(self, batch_size):
        return {f"{self.name}_strength": per_row(self.strength, batch_size, "ablation strength")}

    def act(self, x, on, inputs):
        q, xf = self.basis, x if x.dtype == torch.float32 else x.float()
        coef = (xf @ q.T) * on  # (B, T, K): (a share of) x's coordinates in the span
        out = xf - (coef * q if q.shape[0] == 1 else coef @ q)  # x less that component
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class Clamp(Scheduled):
    """Holds the projection of x on each unit direction u in [lo, hi]:
    x + (clip(x.u, lo, hi) - x.u) u, one direction after another (lo = hi = 0 ablates u).

    Args:
        directions: (D,) or (K, D) (normalised here; orthogonal rows clamp independently).
        lo: a number or (B,) tensor; None is unbounded below.
        hi: a number or (B,) tensor; None is unbounded above; lo <= hi.
        name: runtime-input prefix, as `Steer`.
        device: as `Steer`.
        when: the positions it acts on, as `Steer`.

    Runtime inputs: `<name>_lo`, `<name>_hi` (B,) float32 (unbounded = +-float32 max),
    `<name>_start`, `<name>_end` (B,) int64.

    Example:
        >>> clamp = Clamp(torch.tensor([1.0, 0.0]), lo=-1.0, hi=1.0)
        >>> clamp(torch.tensor([[[5.0, 2.0]]]))
        tensor([[[1., 2.]]])
    """

    def __init__(self, directions, lo=None, hi=None, name="clamp", device=None, when=None):
        super().__init__(name, when)
        rows = as_directions(directions, device)
        lo = torch.as_tensor(-LIMIT if lo is None else lo, dtype=torch.float32, device=rows.device)
        hi = torch.as_tensor(LIMIT if hi is None else hi, dtype=torch.float32, device=rows.device)
        for what, t in (("lo", lo), ("hi", hi)):
            if t.dim() > 1 or torch.isnan(t).any():
                raise ValueError(f"clamp {what} must be a number or a (B,) tensor without NaN, got {t.tolist()}")
        if (lo > hi).any():
            raise ValueError(f"clamp range is inverted: lo {lo.tolist()} > hi {hi.tolist()}; expected lo <= hi")
        self.register_buffer("units", rows / rows.norm(dim=1, keepdim=True))  # (K, D)
        self.register_buffer("lo", lo)
        self.register_buffer("hi", hi)

    def extra_repr(self):
        return f"directions={self.units.shape[0]}, width={self.units.shape[1]}, lo={self.lo.tolist()}, " \
               f"hi={self.hi.tolist()}, when={self.when!r}, name={self.name!r}"

    def own_inputs(self):
        return {f"{self.name}_lo": torch.float32, f"{self.name}_hi": torch.float32}

    def own_defaults(self, batch_size):
        return {f"{self.name}_lo": per_row(self.lo, batch_size, "clamp lo"),
                f"{self.name}_hi": per_row(self.hi, batch_size, "clamp hi")}

    def act(self, x, on, inputs):
        lo, hi = inputs[f"{self.name}_lo"].reshape(-1, 1, 1), inputs[f"{self.name}_hi"].reshape(-1, 1, 1)
        xf = x if x.dtype == torch.float32 else x.float()
        units = self.units
        # K is fixed when the graph is built: an unrolled, branch-free chain
        for u in (units,) if units.shape[0] == 1 else units.split(1):  # (1, D) each
            p = xf @ u.T  # (B, T, 1)
            xf = torch.addcmul(xf, (torch.minimum(torch.maximum(p, lo), hi) - p) * on, u)
        return xf if x.dtype == torch.float32 else xf.to(x.dtype)

