"""Rotary scaling types, computed exactly as transformers' `modeling_rope_utils` computes them.

`check_rope_scaling` validates a scaling dict in transformers' form; `resolve_rope_scaling` fills in
the defaults transformers derives from the config; `rope_tables` gives a type's inverse frequencies
(`Rotary` keeps them as buffers) and `call_inv_freq` picks or recomputes them from one call's length
for the two types that depend on it (dynamic, longrope). `rope_from_hf` reads the rope fields of a
config dict in transformers' v4 or v5 form.

Each formula follows its `_compute_*_parameters` counterpart operation for operation (the same
dtypes, the same order), so the tables agree with transformers' to the bit, not to a tolerance.
"""
import math
from collections.abc import Mapping
from typing import Callable, NamedTuple

import torch

# types that read original_max_position_embeddings (transformers' standardize_rope_params list)
_READS_ORIGINAL = ("llama3", "yarn", "longrope")
_ORIGINAL = "original_max_position_embeddings"


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_positive(v):
    return _is_number(v) and v > 0


def _is_factor_list(v):
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_positive(x) for x in v)


# parameter name -> (check, what it must be); a name means the same thing in every type
_CHECKS = {
    "factor": (_is_positive, "a finite number > 0"),
    "low_freq_factor": (_is_positive, "a finite number > 0"),
    "high_freq_factor": (_is_positive, "a finite number > 0"),
    "attention_factor": (_is_positive, "a finite number > 0"),
    _ORIGINAL: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an integer > 0"),
    "beta_fast": (_is_number, "a finite number"),
    "beta_slow": (_is_number, "a finite number"),
    "mscale": (_is_number, "a finite number"),
    "mscale_all_dim": (_is_number, "a finite number"),
    "truncate": (lambda v: isinstance(v, bool), "True or False"),
    "short_factor": (_is_factor_list, "a list of finite numbers > 0, one per rotated frequency"),
    "long_factor": (_is_factor_list, "a list of finite numbers > 0, one per rotated frequency"),
    "frequency_factors": (_is_factor_list, "a list of finite numbers > 0, one per rotated frequency"),
}


def check_rope_scaling(scaling, *, rotary_dim=None):
    """Validate a rope scaling setting; return it normalised, or None when nothing is scaled.

    Args:
        scaling: None; a number (kvwire's older form: a linear factor, 1.0 = none); or a dict in
            transformers' form: "rope_type" (or the legacy "type") from ROPE_TYPES plus that type's
            parameters under transformers' names. Optional parameters set to None count as absent.
            The sorted (key, value) pairs of such a dict are accepted too (a hashable config).
        rotary_dim: the rotated dims of a head, when known: longrope's factor lists need rotary_dim/2.

    Returns: {"rope_type": ..., parameters sorted by name, lists as tuples}, or None for no scaling
    ("default" type or a factor of 1.0). Defaults are not filled in (see `resolve_rope_scaling`), so
    checking the result again returns it unchanged.

    Example:
        >>> check_rope_scaling({"type": "linear", "factor": 4})
        {'rope_type': 'linear', 'factor': 4}
    """
    if scaling is None:
        return None
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
        if not _is_positive(scaling):
            raise ValueError(f"rope scaling factor {scaling!r}; expected a finite number > 0")
        return None if scaling == 1.0 else {"rope_type": "linear", "factor": scaling}
    if isinstance(scaling, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in scaling):
        scaling = dict(scaling)
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be None, a linear factor or a dict such as "
                         f"{{'rope_type': 'linear', 'factor': 2.0}}; got {type(scaling).__name__} {scaling!r}")
    s = dict(scaling)
    kind, legacy = s.pop("rope_type", None), s.pop("type", None)
    if kind is not None and legacy is not None and kind != legacy:
        raise ValueError(f"rope_scaling has rope_type={kind!r} but type={legacy!r}; expected one type")
    kind = kind if kind is not None else legacy if legacy is not None else "default"  # as transformers
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; expected one of {list(ROPE_TYPES)}")
    spec = ROPE_TYPES[kind]
    s = {k: v for k, v in s.items() if v is not None or k in spec.required}
    unknown = sorted(set(s) - set(spec.required) - set(spec.optional))
    if unknown:
        hint = "; rope_theta and partial_rotary_factor are not scaling parameters (pass base and rotary_dim, " \
               "or read the config with rope_from_hf)" if {"rope_theta", "partial_rotary_factor"} & set(unknown) else ""
        takes = list(spec.required + spec.optional) or "no parameters"
        raise ValueError(f"rope_scaling {kind}: unknown parameter(s) {unknown}; {kind} takes {takes}{hint}")
    for name in spec.required:
        if s.get(name) is None:
            raise ValueError(f"rope_scaling {kind}: {name} is missing; expected {_CHECKS[name][1]}")
    for name, value in s.items():
        ok, what = _CHECKS[name]
        if not ok(value):
            raise ValueError(f"rope_scaling {kind}: {name}={value!r}; expected {what}")
    if kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise ValueError(f"rope_scaling llama3: high_freq_factor={s['high_freq_factor']} must be greater than "
                         f"low_freq_factor={s['low_freq_factor']} (the smoothing divides by their difference)")
    for name in ("short_factor", "long_factor", "frequency_factors"):
        if name in s and rotary_dim is not None and len(s[name]) != rotary_dim // 2:
            raise ValueError(f"rope_scaling {kind}: {name} has {len(s[name])} entries; expected "
                             f"rotary_dim / 2 = {rotary_dim // 2} (one per rotated frequency)")
    if kind == "default":
        return None
    return {"rope_type": kind, **{k: tuple(v) if isinstance(v, list) else v for k, v in sorted(s.items())}}


def resolve_rope_scaling(scaling, rotary_dim, max_position_embeddings=None):
    """Every parameter the maths reads, with transformers' defaults, plus "attention_factor"
    (1.0 for types without one). `scaling` as `check_rope_scaling` takes it.

    Example:
        >>> resolve_rope_scaling({"rope_type": "yarn", "factor": 4.0}, 8, 2048)["attention_factor"]
        1.138629436111989
    """
    s = check_rope_scaling(scaling, rotary_dim=rotary_dim) or {"rope_type": "default"}
    kind, p = s["rope_type"], dict(s)
    if kind in _READS_ORIGINAL and _ORIGINAL not in p:  # transformers' standardize_rope_params default
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling {kind} needs {_ORIGINAL}, or max_position_embeddings to default it to")
        p[_ORIGINAL] = max_position_embeddings
    p.update(ROPE_TYPES[kind].defaults(p, rotary_dim, max_position_embeddings))
    p.setdefault("attention_factor", 1.0)
    return p


def rope_tables(p, base, rotary_dim):
    """{buffer name: (rotary_dim/2,) float32 inverse frequencies} for resolved parameters `p`;
    "inv_freq" is the table of a call within the original context."""
    return ROPE_TYPES[p["rope_type"]].tables(p, base, rotary_dim)


def call_inv_freq(p, tables, seq_len, base, rotary_dim):
    """(rotary_dim/2,) inverse frequencies of a call whose length is `seq_len` (a 0-d int tensor:
    max position + 1), chosen with tensor ops only so traced and exported graphs keep the choice."""
    per_call = ROPE_TYPES[p["rope_type"]].per_call
    return tables["inv_freq"] if per_call is None else per_call(p, tables, seq_len, base, rotary_dim)


def _exponents(dim):
    """(dim/2,) 0, 2/dim, 4/dim, ...: base ** exponents are the wavelengths / 2 pi."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _default(p, base, dim):
    return {"inv_freq": 1.0 / (base ** _exponents(dim))}


def _linear(p, base, dim):  # _compute_linear_scaling_rope_parameters
    return {"inv_freq": 1.0 / (base ** _exponents(dim)) / p["factor"]}


def _frequency_factors(p, base, dim):
    """llama.cpp's `rope_freqs` tensor (Llama 3.x GGUF files): the default frequencies divided by
    per-frequency factors, which its converter computes from the llama3 parameters."""
    return {"inv_freq": 1.0 / (base ** _exponents(dim)) / torch.tensor(p["frequency_factors"], dtype=torch.float32, device="cpu")}


def _dynamic_defaults(p, dim, max_position_embeddings):
    if max_position_embeddings is None:
        raise ValueError("rope_scaling dynamic needs max_position_embeddings (the length beyond which it rescales)")
    if dim <= 2:
        raise ValueError(f"rope_scaling dynamic needs rotary_dim > 2 (its base grows by the power "
                         f"dim / (dim - 2)); got rotary_dim={dim}")
    return {"max_position_embeddings": max_position_embeddings}


def _dynamic(p, base, dim):  # _compute_dynamic_ntk_parameters at init: seq_len = max_position_embeddings
    factor, n = p["factor"], p["max_position_embeddings"]
    base = base * ((factor * n / n) - (factor - 1)) ** (dim / (dim - 2))
    exponents = _exponents(dim)
    return {"inv_freq": 1.0 / (base**exponents), "exponents": exponents}


def _dynamic_call(p, tables, seq_len, base, dim):
    """transformers recomputes the base from the tensor seq_len once a call is longer than
    max_position_embeddings (float32 maths, as there) and uses the init table otherwise."""
    factor, n = p["factor"], p["max_position_embeddings"]
    grown = base * ((factor * seq_len.clamp(min=n) / n) - (factor - 1)) ** (dim / (dim - 2))
    return torch.where(seq_len > n, 1.0 / (grown ** tables["exponents"]), tables["inv_freq"])


def _llama3(p, base, dim):  # _compute_llama3_parameters
    inv_freq = 1.0 / (base ** _exponents(dim))
    factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p[_ORIGINAL]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long waves: interpolated
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return {"inv_freq": torch.where(medium, smoothed, scaled)}


def _yarn_defaults(p, dim, max_position_embeddings):
    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, out = p["factor"], {}
    if p.get("attention_factor") is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        out["attention_factor"] = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    # transformers reads `get(...) or 32`, so an explicit 0 also means the default
    out["beta_fast"], out["beta_slow"] = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    out["truncate"] = p.get("truncate", True)
    return out


def _yarn(p, base, dim):  # _compute_yarn_parameters
    factor, old = p["factor"], p[_ORIGINAL]

    def correction_dim(rotations):  # the dim that turns `rotations` times over the original context
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** _exponents(dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled frequency: 1 for the fast dims, 0 for the slow ones
    return {"inv_freq": interpolation * (1 - keep) + extrapolation * keep}


def _longrope_defaults(p, dim, max_position_embeddings):
    factor, old, out = p.get("factor"), p[_ORIGINAL], {}
    if factor is None:  # Phi-3: the ratio of the two context lengths
        if max_position_embeddings is None:
            raise ValueError("rope_scaling longrope needs factor, or max_position_embeddings to derive it "
                             f"(max_position_embeddings / {_ORIGINAL})")
        factor = out["factor"] = max_position_embeddings / old
    if p.get("attention_factor") is None:
        out["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    return out


def _longrope(p, base, dim):  # _compute_longrope_parameters, short (init) and long tables
    shape = _exponents(dim)

    def table(factors):
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base**shape)

    return {"inv_freq": table(p["short_factor"]), "long_inv_freq": table(p["long_factor"])}


def _longrope_call(p, tables, seq_len, base, dim):
    return torch.where(seq_len > p[_ORIGINAL], tables["long_inv_freq"], tables["inv_freq"])


class _RopeType(NamedTuple):
    required: tuple
    optional: tuple
    tables: Callable
    defaults: Callable = lambda p, dim, max_position_embeddings: {}
    per_call: Callable = None  # for types whose frequencies depend on the call's length


ROPE_TYPES = {
    "default": _RopeType((), (), _default),
    "linear": _RopeType(("factor",), (), _linear),
    "dynamic": _RopeType(("factor",), (), _dynamic, _dynamic_defaults, _dynamic_call),
    "llama3": _RopeType(("factor", "low_freq_factor", "high_freq_factor"), (_ORIGINAL,), _llama3),
    "yarn": _RopeType(("factor",), (_ORIGINAL, "attention_factor", "beta_fast", "beta_slow", "mscale",
                                    "mscale_all_dim", "truncate"), _yarn, _yarn_defaults),
    "longrope": _RopeType(("short_factor", "long_factor"), ("factor", _ORIGINAL, "attention_factor"),
                          _longrope, _longrope_defaults, _longrope_call),
    # kvwire's own, not transformers': what a GGUF file stores instead of llama3's parameters
    "frequency_factors": _RopeType(("frequency_factors",), (), _frequency_factors),
}


def rope_from_hf(d, aliases=None):
    """(theta, scaling, partial_rotary_factor) from a Hugging Face config dict, popping the keys read.

    Reads either form: transformers v4 (`rope_theta`, `rope_scaling`, top-level
    `partial_rotary_factor`) or v5 (`rope_parameters` = {"rope_type", "rope_theta",
    "partial_rotary_factor"?, the type's parameters}); where both are present they must agree. A
    top-level `original_max_position_embeddings` (Phi-3) goes into the scaling of the types that
    read it, and one still missing defaults to `max_position_embeddings`, as transformers'
    `standardize_rope_params` does. Defaults: theta 10000.0, partial_rotary_factor 1.0; scaling is
    `check_rope_scaling`'s normalised dict or None. `aliases` maps a family's other names of rope
    types to transformers' (Phi-3 reads "su" and "yarn" as {"su": "longrope", ...}). Per-layer-type
    `rope_parameters` (Gemma 3) are the family's to route: it reads each layer type's through here.

    Example:
        >>> rope_from_hf({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
        (500000.0, {'rope_type': 'linear', 'factor': 2.0}, 1.0)
    """
    v5 = d.pop("rope_parameters", None)
    theta, partial = d.pop("rope_theta", None), d.pop("partial_rotary_factor", None)
    outer_original = d.pop(_ORIGINAL, None)
    scaling = _with_original(check_rope_scaling(_alias(d.pop("rope_scaling", None), aliases)), outer_original, d)
    if v5 is not None:
        if not isinstance(v5, Mapping):
            raise ValueError(f"rope_parameters={v5!r}; expected a dict such as {{'rope_type': 'default', "
                             f"'rope_theta': 10000.0}}")
        nested = sorted(k for k, v in v5.items() if isinstance(v, Mapping))
        if nested:
            raise ValueError(f"rope_parameters holds per-layer-type dicts {nested}; those are read by the "
                             f"family's config (Gemma 3), not by rope_from_hf")
        rest = dict(v5)
        theta = _agree("rope_theta", theta, rest.pop("rope_theta", None))
        partial = _agree("partial_rotary_factor", partial, rest.pop("partial_rotary_factor", None))
        v5_scaling = _with_original(check_rope_scaling(_alias(rest, aliases)), outer_original, d)
        if scaling is not None and scaling != v5_scaling:
            raise ValueError(f"rope_scaling={scaling!r} disagrees with rope_parameters' {v5_scaling!r}; "
                             f"expected one setting")
        scaling = v5_scaling
    return (10_000.0 if theta is None else theta), scaling, (1.0 if partial is None else partial)


def _alias(scaling, aliases):
    """`scaling` with a type named in `aliases` renamed to transformers' name (as "rope_type")."""
    if not aliases or not isinstance(scaling, Mapping):
        return scaling
    kind = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(kind, str) or kind not in aliases:
        return scaling
    return {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": aliases[kind]}


def _agree(name, v4, v5):
    if v4 is not None and v5 is not None and v4 != v5:
        raise ValueError(f"config has {name}={v4!r} but rope_parameters has {name}={v5!r}; expected one value")
    return v4 if v5 is None else v5


def _with_original(scaling, outer, d):
    """Fill original_max_position_embeddings of the types that read it (top level first)."""
    if scaling is None or scaling["rope_type"] not in _READS_ORIGINAL:
        return scaling
    inner = scaling.get(_ORIGINAL)
    if outer is not None and inner is not None and outer != inner:
        raise ValueError(f"config has {_ORIGINAL}={outer!r} but its rope scaling has {inner!r}; expected one value")
    value = next((v for v in (inner, outer, d.get("max_position_embeddings")) if v is not None), None)
    return scaling if value is None else check_rope_scaling({**scaling, _ORIGINAL: value})
