"""SAE feature steering: `SAEEdit`, a branch-free layer that sets, adds to or clamps chosen features
of a sparse autoencoder at a block site, and `steer_features`, which edits it into a model.

The layer adds only the change it makes in feature space, decoded: `x + (f' - f)[idx] @ W_dec[idx]`.
The SAE's reconstruction error stays in x, and features it leaves alone cost nothing.
"""
import math
import operator

import torch

from .apply import insert_at_site
from .ops import LIMIT
from .sae_file import SAE, hook_site
from .schedule import Scheduled, per_row

MODES = ("set", "add", "clamp")

__all__ = ["MODES", "SAE", "SAEEdit", "hook_site", "steer_features"]


class SAEEdit(Scheduled):
    """Edits K chosen SAE features of x at the scheduled positions and adds the decoded change.

    f = act(x @ W_enc[:, idx] + b_enc[idx] - b_dec @ W_enc[:, idx] * apply_b_dec_to_input) (B, T, K), then
    "set": f_i := v_i;  "add": f_i := f_i + v_i;  "clamp": f_i := clip(f_i, lo_i, hi_i);  and
    x + (f' - f) @ W_dec[idx]. Computed in float32, returned in x's dtype.

    Args:
        sae: an `SAE` (only its K chosen columns and rows are kept, as buffers).
        features: {feature index: value} ("set", "add") or {index: (lo, hi)} ("clamp"; None is
            unbounded on that side); values are finite numbers, the defaults of the runtime inputs.
        mode: one of `MODES`.
        name: runtime-input prefix (default "sae").
        device: where the buffers and defaults are kept, as `Steer`.
        when: the positions it acts on (see `kvwire.steer.schedule`).

    Runtime inputs, (B,) each: `<name>_f<i>` float32 per feature i ("set", "add"), or
    `<name>_f<i>_lo` and `<name>_f<i>_hi` ("clamp"); `<name>_start`, `<name>_end` int64.

    Example:
        >>> edit = SAEEdit(sae, {3: 8.0}, mode="set")
        >>> sae.encode(edit(x))[..., 3]   # 8.0 wherever the feature fires after the edit
    """

    def __init__(self, sae, features, mode="set", name="sae", device=None, when=None):
        if not isinstance(sae, SAE):
            raise TypeError(f"sae must be a kvwire SAE (SAE.load(folder)), got {type(sae).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.features = mode, _indices(features, sae.d_sae)  # read by own_inputs
        super().__init__(name, when)
        values = [_value(i, features[i], mode) for i in features]
        idx = torch.tensor(self.features, device=sae.W_enc.device)
        enc = sae.W_enc[:, idx].double()  # (D, K): only the chosen features are encoded, not all F
        bias = sae.b_enc[idx].double() - float(sae.apply_b_dec_to_input) * (sae.b_dec.double() @ enc)
        threshold = torch.zeros(len(idx), device=idx.device) if sae.threshold is None else sae.threshold[idx]
        kept = {"dec": sae.W_dec[idx]}  # (K, D)
        if mode != "add":  # adding needs no encoding
            kept.update(enc=enc, bias=bias, threshold=threshold)
        for key, t in kept.items():
            if not torch.isfinite(t).all():
                raise ValueError(f"the SAE's {key} for features {self.features} holds NaN or infinite values")
            self.register_buffer(key, t.to(device=device, dtype=torch.float32).contiguous())
        if mode == "clamp":
            self.register_buffer("lo", torch.tensor([v[0] for v in values], device=device))
            self.register_buffer("hi", torch.tensor([v[1] for v in values], device=device))
        else:
            self.register_buffer("values", torch.tensor(values, device=device))

    def extra_repr(self):
        shown = list(zip(self.lo.tolist(), self.hi.tolist())) if self.mode == "clamp" else self.values.tolist()
        return f"mode={self.mode!r}, features={dict(zip(self.features, shown))}, width={self.dec.shape[1]}, " \
               f"when={self.when!r}, name={self.name!r}"

    def _keys(self):
        """Names of the runtime inputs per feature: [(value,)] or [(lo, hi)], in feature order."""
        if self.mode == "clamp":
            return [(f"{self.name}_f{i}_lo", f"{self.name}_f{i}_hi") for i in self.features]
        return [(f"{self.name}_f{i}",) for i in self.features]

    def own_inputs(self):
        return {key: torch.float32 for keys in self._keys() for key in keys}

    def own_defaults(self, batch_size):
        columns = (self.lo, self.hi) if self.mode == "clamp" else (self.values,)
        return {key: per_row(column[k], batch_size, key)
                for k, keys in enumerate(self._keys()) for key, column in zip(keys, columns)}

    def act(self, x, on, inputs):
        xf, keys = x.float(), self._keys()

        def given(j):  # (B, 1, K): the j-th runtime input of every feature
            return torch.stack([inputs[k[j]] for k in keys], dim=-1)[:, None]

        if self.mode == "add":  # f + v - f: the change needs no encoding
            change = given(0) * on
        else:
            pre = xf @ self.enc + self.bias  # (B, T, K)
            f = torch.relu(pre) * (pre > self.threshold).to(torch.float32)
            target = torch.minimum(torch.maximum(f, given(0)), given(1)) if self.mode == "clamp" else given(0)
            change = (target - f) * on
        return (xf + change @ self.dec).to(x.dtype)


def steer_features(lm, sae, features, *, mode="set", layer=None, site=None, when=None, name=None):
    """The same model with `features` of `sae` edited at its hook (or at `site` of block `layer`).

    Args:
        lm: a CausalLM.
        sae: an `SAE` whose d_in is the model's hidden size.
        features: {feature index: value}, or {index: (lo, hi)} for "clamp" (see `SAEEdit`).
        mode: "set", "add" or "clamp".
        layer: the block to edit (default: the block of the SAE's hook_name, see `hook_site`).
        site: the site of that block (default: the hook_name's site).
        when: the positions edited (see `kvwire.steer.schedule`).
        name: runtime-input prefix; None: "sae", or "sae2", "sae3", ... when taken.

    Returns the edited CausalLM (weights shared); its cached graph takes the runtime inputs of
    `SAEEdit`, so rows of one batch can each have their own values.

    Example:
        >>> sae = SAE.load("gemma-scope/layer_6")
        >>> calm = steer_features(lm, sae, {1024: 0.0, 77: 12.0})
        >>> calm.generate(["Hi", "Hey"], max_new_tokens=20, inputs={"sae_f77": torch.tensor([12.0, 0.0])})
    """
    if not isinstance(sae, SAE):
        raise TypeError(f"sae must be a kvwire SAE (SAE.load(folder)), got {type(sae).__name__}")
    width = lm.head.weight.shape[1]
    if sae.d_in != width:
        raise ValueError(f"the SAE reads vectors of width {sae.d_in} (d_in) but this model's hidden size is {width}")
    if layer is None:
        hooked_site, layer = sae.location()  # hook_layer must agree with the hook name's block
        site = hooked_site if site is None else site
    elif site is None:
        site = hook_site(sae.hook_name)[0]
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be a block index (int), got {type(layer).__name__}")
    # the shared insertion: after what is at the site already, names counted up, shared names checked
    # (b_dec stands for the SAE's width, which is checked above)
    return insert_at_site(lm, {layer: sae.b_dec}, site, name, "sae",
                          lambda _, n, device: SAEEdit(sae, features, mode, n, device=device, when=when))


def _indices(features, d_sae):
    """The feature indices in the order given, each an int in [0, d_sae)."""
    if not isinstance(features, dict) or not features:
        raise TypeError(f"features must be a non-empty {{feature index: value}} dict, got {features!r}")
    out = []
    for i in features:
        try:
            index = None if isinstance(i, bool) else operator.index(i)
        except TypeError:
            index = None
        if index is None:
            raise TypeError(f"feature indices must be ints, got {i!r} ({type(i).__name__})")
        if not 0 <= index < d_sae:
            raise ValueError(f"feature index {i!r} is out of range: this SAE has {d_sae} features (0 to {d_sae - 1})")
        out.append(index)
    return out


def _value(i, value, mode):
    """A finite float ("set", "add") or a (lo, hi) pair with lo <= hi, None unbounded ("clamp")."""
    if mode == "clamp":
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"feature {i}: clamp takes a (lo, hi) pair (None: unbounded), got {value!r}")
        lo, hi = (_number(i, v, what) if v is not None else bound
                  for v, what, bound in zip(value, ("lo", "hi"), (-LIMIT, LIMIT)))
        if lo > hi:
            raise ValueError(f"feature {i}: clamp range is inverted: lo {lo} > hi {hi}; expected lo <= hi")
        return lo, hi
    return _number(i, value, "value")


def _number(i, value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        raise TypeError(f"feature {i}: {what} must be a number, got {value!r}; give per-row values at run time "
                        f"as inputs")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"feature {i}: {what} must be finite, got {value}")
    return value
