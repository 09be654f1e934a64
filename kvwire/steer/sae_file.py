"""`SAE`: a sparse autoencoder's weights, read from SAELens's on-disk format (a folder with
`cfg.json` and `sae_weights.safetensors`), and where in a kvwire block its hook point is.

Both config layouts SAELens writes are read: before 6.0 the hook is top level (`hook_name` or
`hook_point`, `hook_layer`); from 6.0 it is under `metadata` (`meta` in some 6.0 pre-releases).
"""
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..io.tokenizer import read_json

ARCHITECTURES = ("standard", "jumprelu")  # ReLU and JumpReLU encoders: what `SAEEdit` computes
CFG, WEIGHTS = "cfg.json", "sae_weights.safetensors"
REQUIRED = ("W_enc", "W_dec", "b_enc", "b_dec")
SCALES = ("scaling_factor", "finetuning_scaling_factor")  # all ones: a no-op older SAELens versions saved

# TransformerLens hook point -> kvwire site (`kvwire.layers.site`)
TL_SITES = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid", "hook_resid_post": "block_out",
            "hook_attn_out": "attn_out", "hook_mlp_out": "mlp_out"}
_TL = re.compile(r"blocks\.(\d+)\.(\w+)")
# Hugging Face module names whose output is a decoder block's output (Gemma Scope 2, Llama Scope style)
_HF_BLOCK = re.compile(r"(?:model\.(?:language_model\.)?layers|transformer\.h)\.(\d+)(?:\.output)?")
HOOK_PATTERNS = (", ".join(f"blocks.{{L}}.{h}" for h in TL_SITES)
                 + ", model.layers.{L}[.output], model.language_model.layers.{L}[.output], transformer.h.{L}")


def hook_site(hook_name):
    """(site, block index) of a SAELens hook name; a ValueError naming it when it is not one of
    `HOOK_PATTERNS`.

    Example:
        >>> hook_site("blocks.6.hook_resid_post")
        ('block_out', 6)
    """
    name = str(hook_name)
    tl = _TL.fullmatch(name)
    if tl and tl.group(2) in TL_SITES:
        return TL_SITES[tl.group(2)], int(tl.group(1))
    hf = _HF_BLOCK.fullmatch(name)
    if hf:
        return "block_out", int(hf.group(1))
    raise ValueError(f"SAE hook_name {hook_name!r} is not a hook kvwire can place; supported: {HOOK_PATTERNS}. "
                     f"Pass site= and layer= to place it yourself")


@dataclass(eq=False)
class SAE:
    """A ReLU or JumpReLU sparse autoencoder: `f = act((x - b_dec * apply_b_dec_to_input) @ W_enc
    + b_enc)`, `x_hat = f @ W_dec + b_dec`, with JumpReLU's `act(p) = relu(p) * (p > threshold)`.

    Args:
        W_enc: (D, F) encoder (D = d_in, the model's width; F = d_sae, the features).
        b_enc: (F,) encoder bias.
        W_dec: (F, D) decoder: row i is feature i's direction.
        b_dec: (D,) decoder bias.
        threshold: (F,) JumpReLU thresholds, or None (ReLU).
        apply_b_dec_to_input: subtract b_dec from x before encoding.
        hook_name: where it was trained, in SAELens's names (see `hook_site`).
        hook_layer: the block of hook_name, where the config gives it.

    Tensors keep the file's dtype (a wide SAE is large); `encode`/`decode` compute in float32.

    Example:
        >>> sae = SAE.load("saes/blocks.6.hook_resid_post")
        >>> sae.d_in, sae.d_sae, sae.location()
        (768, 24576, ('block_out', 6))
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor = None
    apply_b_dec_to_input: bool = True
    hook_name: str = None
    hook_layer: int = None

    def __post_init__(self):
        if self.W_enc.dim() != 2:
            raise ValueError(f"W_enc must be (d_in, d_sae), got shape {tuple(self.W_enc.shape)}")
        D, F = self.W_enc.shape
        want = {"W_dec": (F, D), "b_enc": (F,), "b_dec": (D,), "threshold": (F,)}
        for key, shape in want.items():
            t = getattr(self, key)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{key} must have shape {shape} for W_enc of shape {(D, F)}, got {tuple(t.shape)}")

    @property
    def d_in(self):
        return self.W_enc.shape[0]

    @property
    def d_sae(self):
        return self.W_enc.shape[1]

    @property
    def architecture(self):
        return "standard" if self.threshold is None else "jumprelu"

    def encode(self, x):
        """x (..., D) -> feature activations (..., F) float32."""
        x = x.float() - self.b_dec.float() * float(self.apply_b_dec_to_input)
        pre = x @ self.W_enc.float() + self.b_enc.float()
        threshold = 0.0 if self.threshold is None else self.threshold.float()
        return torch.relu(pre) * (pre > threshold).to(torch.float32)

    def decode(self, f):
        """Feature activations (..., F) -> reconstruction (..., D) float32."""
        return f.float() @ self.W_dec.float() + self.b_dec.float()

    def location(self):
        """(site, block index) of the hook it was trained at (`hook_site`); checks hook_layer agrees."""
        site, layer = hook_site(self.hook_name)
        if self.hook_layer is not None and self.hook_layer != layer:
            raise ValueError(f"SAE hook_name {self.hook_name!r} is block {layer} but hook_layer is {self.hook_layer}; "
                             f"pass layer= to choose")
        return site, layer

    @classmethod
    def load(cls, folder):
        """Read a SAELens folder (`cfg.json`, `sae_weights.safetensors`) from local files.

        Refused, by name: architectures other than "standard" and "jumprelu", activation functions
        other than ReLU, `normalize_activations` other than "none", per-head (`hook_z`) SAEs,
        scaling factors other than 1 and tensors it does not know.
        """
        folder = Path(folder)
        cfg_path, weights_path = folder / CFG, folder / WEIGHTS
        for path in (cfg_path, weights_path):
            if not path.is_file():
                raise ValueError(f"{folder} has no {path.name}; expected a SAELens SAE folder ({CFG}, {WEIGHTS})")
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
        _check_cfg(cfg, cfg_path)
        try:
            tensors = load_file(str(weights_path))
        except Exception as e:  # the safetensors library checks the header against the file
            raise ValueError(f"{weights_path} is not a readable safetensors file: {e}") from e
        sae = cls(**_weights(tensors, cfg, weights_path),
                  apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
                  hook_name=_meta(cfg, "hook_name") or _meta(cfg, "hook_point"), hook_layer=_meta(cfg, "hook_layer"))
        for key, got in (("d_in", sae.d_in), ("d_sae", sae.d_sae)):
            if key in cfg and cfg[key] != got:
                raise ValueError(f"{cfg_path}: {key} is {cfg[key]} but the weights have {got}")
        return sae


def _meta(cfg, key):
    """A hook field: top level (SAELens < 6) or under metadata (>= 6)."""
    for where in (cfg, cfg.get("metadata"), cfg.get("meta")):
        if isinstance(where, dict) and where.get(key) is not None:
            return where[key]
    return None


def _check_cfg(cfg, path):
    arch = cfg.get("architecture", "standard")  # SAELens's default for configs without one
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; kvwire reads {list(ARCHITECTURES)} SAEs")
    act = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
    if act != "relu":
        raise ValueError(f"{path}: activation_fn {act!r} is not supported; kvwire reads ReLU (and JumpReLU) SAEs")
    norm = cfg.get("normalize_activations")
    if norm not in (None, "none", False):
        raise ValueError(f"{path}: normalize_activations is {norm!r}; kvwire supports 'none' only (inputs as the "
                         f"model gives them: fold a constant scale into W_enc, b_enc, W_dec and b_dec first)")
    for key, plain in (("reshape_activations", "none"), ("hook_head_index", None)):
        if cfg.get(key, plain) not in (plain, None):
            raise ValueError(f"{path}: {key} is {cfg[key]!r}; kvwire edits whole-width sites, not one head's output")


def _weights(tensors, cfg, path):
    tensors = dict(tensors)
    if "log_threshold" in tensors and "threshold" not in tensors:  # a training checkpoint's JumpReLU
        tensors["threshold"] = tensors.pop("log_threshold").float().exp()
    for key in SCALES:
        if key in tensors:
            scale = tensors.pop(key)
            if not torch.all(scale == 1):
                raise ValueError(f"{path}: {key} is not all ones; kvwire does not apply SAELens's fine-tuning scale")
    missing = [k for k in REQUIRED if k not in tensors]
    unknown = sorted(set(tensors) - {*REQUIRED, "threshold"})
    if missing or unknown:
        raise ValueError(f"{path}: " + "; ".join(
            ([f"missing tensors {missing}"] if missing else []) + ([f"unknown tensors {unknown}"] if unknown else []))
            + f"; a {'/'.join(ARCHITECTURES)} SAE has {list(REQUIRED)} and, for jumprelu, 'threshold'")
    arch = cfg.get("architecture", "standard")
    if (arch == "jumprelu") != ("threshold" in tensors):
        raise ValueError(f"{path}: architecture {arch!r} " + ("needs a 'threshold' tensor" if arch == "jumprelu"
                                                               else "has no threshold, but the file holds one"))
    return {k: tensors.get(k) for k in (*REQUIRED, "threshold")}
