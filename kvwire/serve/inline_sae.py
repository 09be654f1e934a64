"""SAE features a request sets, adds to or clamps (`sae_features`, `sae_mode`): a bank of F feature
slots at the SAE's site, lent to requests.

The served model holds, at the SAE's hook (a site of one block; see `kvwire.steer.sae.hook_site`),
one `FeatureSlots` layer: F slots, each one feature's encoder column, bias, threshold and decoder
row (zero at first), and per slot j three per-row inputs, `sae{j}_add`, `sae{j}_lo`, `sae{j}_hi`
(0, -float32 max, float32 max by default: inert). With f the slots' activations,

    f = relu(pre) * (pre > threshold),  pre = x @ enc + bias                   (B, T, F)
    x + ((add + clip(f, lo, hi) - f) * on) @ dec

so a row setting feature i to v has lo = hi = v in i's slot, a row adding v has add = v, and a row
clamping has its lo, hi: the change is `SAEEdit`'s (`kvwire.steer.sae`) for the same features, and
every other row leaves the slot inert. A slot holds a feature, not a request: requests asking for
the same feature share its slot (counted), so F bounds the distinct features in use at once. A
free slot is written when a request takes it (no row reads it then), and freed when the last
request holding it ends.

Design: a bank, not a feature list fixed at start-up, so any feature of the SAE can be asked for by
any request, and the graph's inputs stay (B,) numbers per slot; the cost is a (B, T, D) x (D, F)
encoding and a (B, T, F) x (F, D) decoding per step at one block. The slots are weights, so an
exported served graph has them fixed (and inert): per-request SAE features are a server feature;
for an exported model, edit the features in with `steer_features` before exporting.

Wire format: `"sae_features": {"<feature index>": value, ...}` and `"sae_mode"`: "set" (default)
and "add" take a number per feature; "clamp" takes [lo, hi] (null: unbounded on that side).
Too many features, a bad index (naming the SAE's d_sae) or value: 400; no free slot: 429 with
Retry-After.
"""
import math
import threading

import torch

from ..graph import insert_after
from ..graph.sites import site_targets
from ..steer.ops import LIMIT
from ..steer.sae import MODES, SAE, hook_site
from ..steer.schedule import Scheduled
from .errors import APIError


class FeatureSlots(Scheduled):
    """F SAE feature slots at one site (see the module docstring for the formula).

    Buffers: enc (D, F), bias (F,), threshold (F,), dec (F, D), written in place by
    `FeatureBank.acquire`. Runtime inputs, (B,) float32 for j < F: `<name>{j}_add` (default 0),
    `<name>{j}_lo` (default -float32 max), `<name>{j}_hi` (default float32 max); and the
    schedule's `<name>_start`/`_end`.
    """

    def __init__(self, slots, width, name="sae", device=None):
        super().__init__(name)
        self.register_buffer("enc", torch.zeros(width, slots, device=device))
        self.register_buffer("bias", torch.zeros(slots, device=device))
        self.register_buffer("threshold", torch.zeros(slots, device=device))
        self.register_buffer("dec", torch.zeros(slots, width, device=device))
        self.slots = slots

    def own_inputs(self):
        return {f"{self.name}{j}_{what}": torch.float32 for j in range(self.slots) for what in ("add", "lo", "hi")}

    def own_defaults(self, batch_size):
        fill = {"add": 0.0, "lo": -LIMIT, "hi": LIMIT}
        return {name: torch.full((batch_size,), fill[name.rsplit("_", 1)[1]], device=self.dec.device)
                for name in self.own_inputs()}

    def act(self, x, on, inputs):
        def given(what):  # (B, 1, F): one input of every slot
            return torch.stack([inputs[f"{self.name}{j}_{what}"] for j in range(self.slots)], dim=-1)[:, None]

        xf = x.float()
        pre = xf @ self.enc + self.bias  # (B, T, F)
        f = torch.relu(pre) * (pre > self.threshold).to(torch.float32)
        change = (given("add") + (torch.minimum(torch.maximum(f, given("lo")), given("hi")) - f)) * on
        return (xf + change @ self.dec).to(x.dtype)


class FeatureBank:
    """F feature slots of `sae` in the served graph (see the module docstring).

    Args:
        lm: the model. sae: an `SAE` whose d_in is the model's width. slots: F >= 1.
        per_request: features one request may carry (1 <= per_request, at most F).
        site, layer: where it edits (default: the SAE's hook, as `steer_features`).

    Example:
        >>> bank = FeatureBank(lm, SAE.load("saes/blocks.6.hook_resid_post"), slots=16)
        >>> served = bank.apply(lm)
        >>> asked = bank.parse({"77": 12.0}, "set")   # [(77, {"add": 0.0, "lo": 12.0, "hi": 12.0})]
        >>> slots = bank.acquire(asked); inputs = bank.inputs(slots, asked); bank.release(slots)
    """

    def __init__(self, lm, sae, slots=16, per_request=4, site=None, layer=None):
        if not isinstance(sae, SAE):
            raise TypeError(f"sae must be a kvwire SAE (SAE.load(folder)), got {type(sae).__name__}")
        for what, n in (("SAE slots (--sae-slots)", slots), ("SAE features per request (--sae-per-request)",
                                                            per_request)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        self.width = lm.head.weight.shape[1]
        if sae.d_in != self.width:
            raise ValueError(f"the SAE reads vectors of width {sae.d_in} (d_in) but this model's hidden size is "
                             f"{self.width}")
        _check_weights(sae)
        if layer is None:
            hooked, layer = sae.location()
            site = hooked if site is None else site
        elif site is None:
            site = hook_site(sae.hook_name)[0]
        self.sae, self.site, self.block = sae, site, layer
        self.per_request = min(per_request, slots)
        self.depth, targets = site_targets(lm.backbone, site, [layer])  # refuses a site the block lacks
        self.calls = targets[layer]
        self.layer = FeatureSlots(slots, self.width, device=lm.device)
        self.held = [None] * slots  # [feature index, requests holding it] per slot; None: free
        self._lock = threading.Lock()

    @property
    def slots(self):
        return len(self.held)

    def apply(self, lm):
        """`lm` with the bank's layer (shared, not copied) after the site, after what is there."""
        return lm.edit(insert_after(list(self.calls), lambda call, layer: self.layer), depth=self.depth)

    def describe(self):
        return {"d_sae": self.sae.d_sae, "site": self.site, "layer": self.block, "slots": self.slots,
                "per_request": self.per_request, "modes": list(MODES)}

    def parse(self, features, mode):
        """A request's `sae_features` and `sae_mode` -> [(feature index, {"add", "lo", "hi"})];
        APIError 400 naming what is wrong."""
        mode = "set" if mode is None else mode
        if mode not in MODES:
            raise _bad(f"sae_mode is {mode!r}; expected one of {list(MODES)}", "sae_mode")
        if not features:
            raise _bad("sae_features is empty; expected {\"<feature index>\": value, ...}")
        if len(features) > self.per_request:
            raise _bad(f"sae_features has {len(features)} features; this server allows at most {self.per_request} "
                       f"per request")
        out, seen = [], set()
        for key, value in features.items():
            index = int(key) if str(key).isascii() and str(key).isdecimal() else None
            if index is None or index >= self.sae.d_sae:
                raise _bad(f"sae_features has feature {key!r}; expected an index in [0, {self.sae.d_sae}) (the "
                           f"SAE's d_sae is {self.sae.d_sae})")
            if index in seen:
                raise _bad(f"sae_features names feature {index} twice")
            seen.add(index)
            out.append((index, _values(value, mode, f"sae_features.{key}")))
        return out

    def acquire(self, asked):
        """Hold a slot for each feature of `asked` (`parse`'s list), sharing a slot that holds it
        already; returns the slots. APIError 429 when no slot is free (nothing held then)."""
        slots, fresh = [], []
        with self._lock:
            for index, _ in asked:
                slot = next((j for j, h in enumerate(self.held) if h is not None and h[0] == index), None)
                if slot is None:
                    slot = next((j for j, h in enumerate(self.held) if h is None), None)
                    if slot is None:
                        self._release(slots)
                        raise APIError(f"all {self.slots} SAE feature slots hold other features; retry shortly",
                                       param="sae_features", code="sae_slots_busy", status=429,
                                       headers={"Retry-After": "1"})
                    self.held[slot] = [index, 0]
                    fresh.append((slot, index))
                self.held[slot][1] += 1
                slots.append(slot)
        for slot, index in fresh:  # no row reads a fresh slot until this request's rows are placed
            self._write(slot, index)
        return slots

    def inputs(self, slots, asked):
        """The runtime inputs of a row with `asked` in `slots`."""
        return {f"sae{j}_{what}": v for j, (_, values) in zip(slots, asked) for what, v in values.items()}

    def key(self, slots, asked):
        """What the row's slots hold (the prefix store keys rows on it)."""
        return tuple(f"sae{j}={index}" for j, (index, _) in zip(slots, asked))

    def release(self, slots):
        with self._lock:
            self._release(slots)

    def _release(self, slots):
        for j in slots:
            self.held[j][1] -= 1
            if self.held[j][1] == 0:
                self.held[j] = None

    def _write(self, slot, index):
        sae, layer = self.sae, self.layer
        enc = sae.W_enc[:, index].double()  # as `SAEEdit`: b_dec folded into the bias in float64
        bias = sae.b_enc[index].double() - float(sae.apply_b_dec_to_input) * (sae.b_dec.double() @ enc)
        threshold = 0.0 if sae.threshold is None else sae.threshold[index]
        layer.enc[:, slot].copy_(enc)
        layer.bias[slot].copy_(torch.as_tensor(bias))
        layer.threshold[slot].copy_(torch.as_tensor(threshold))
        layer.dec[slot].copy_(sae.W_dec[index])


def _check_weights(sae):
    """ValueError when the SAE's weights hold NaN or infinite values (refused at start-up: a request
    must not find out)."""
    for key in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        t = getattr(sae, key)
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(f"the SAE's {key} holds NaN or infinite values")


def _values(value, mode, where):
    """{"add", "lo", "hi"} of one feature: set v -> lo = hi = v; add v -> add = v; clamp [lo, hi]."""
    if mode == "clamp":
        if not isinstance(value, list) or len(value) != 2:
            raise _bad(f"{where} is {value!r}; sae_mode 'clamp' takes [lo, hi] (null: unbounded on that side)")
        lo, hi = (_finite(v, f"{where}[{k}]") for k, v in enumerate(value))
        if lo is not None and hi is not None and lo > hi:
            raise _bad(f"{where}: lo {lo} > hi {hi}; expected lo <= hi")
        return {"add": 0.0, "lo": -LIMIT if lo is None else lo, "hi": LIMIT if hi is None else hi}
    if isinstance(value, list) or value is None:
        raise _bad(f"{where} is {value!r}; sae_mode {mode!r} takes a number (a [lo, hi] pair is for 'clamp')")
    v = _finite(value, where)
    return {"add": 0.0, "lo": v, "hi": v} if mode == "set" else {"add": v, "lo": -LIMIT, "hi": LIMIT}


def _finite(value, where):
    if value is not None and not (math.isfinite(value) and abs(value) <= LIMIT):
        raise _bad(f"{where} is {value}; expected a finite float32 number")
    return None if value is None else float(value)


def _bad(message, param="sae_features"):
    return APIError(message, param=param, code="invalid_value")
