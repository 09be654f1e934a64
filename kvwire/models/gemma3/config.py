"""Gemma 3 text config, with Hugging Face field names, and its mapping onto the shared decoder."""
import math
from dataclasses import dataclass

from ..config import check_fields, from_hf_dict
from ..decoder import DecoderConfig

_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "query_pre_attn_scalar",
             "sliding_window", "sliding_window_pattern", "rope_theta", "rope_local_base_freq",
             "final_logit_softcapping")


@dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 (text) hyper-parameters. `layer_types` is computed once from `sliding_window_pattern`
    (every n-th layer full) when not given. Rope: `rope_theta` for full layers, `rope_local_base_freq`
    for sliding ones; `rope_scaling` may be None or {"rope_type": "linear", "factor": f} (full layers).
    """

    vocab_size: int = 262_144
    hidden_size: int = 640
    intermediate_size: int = 2048
    num_hidden_layers: int = 18
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 32_768
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: tuple = None
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict = None
    final_logit_softcapping: float = None
    attn_logit_softcapping: float = None
    attention_bias: bool = False
    bos_token_id: int = 2
    eos_token_id: object = 1
    pad_token_id: int = 0

    def __post_init__(self):
        check_fields(self, _POSITIVE, layers="num_hidden_layers")
        if self.layer_types is None:  # every n-th layer full
            p = self.sliding_window_pattern
            types = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(self.num_hidden_layers)]
            object.__setattr__(self, "layer_types", types)
        if self.attn_logit_softcapping is not None:  # transformers' Gemma 3 never applies it
            raise ValueError(f"attn_logit_softcapping={self.attn_logit_softcapping} is not part of Gemma 3 "
                             f"(its reference implementation ignores it); expected None")
        _check_rope_scaling(self.rope_scaling)
        # the shared decoder's config checks the rest (head counts, eps, layer_types)
        object.__setattr__(self, "layer_types", self.decoder().layer_types)

    @property
    def full_rope_factor(self):
        s = self.rope_scaling or {}
        return float(s.get("factor", 1.0)) if s.get("rope_type", s.get("type")) == "linear" else 1.0

    def decoder(self):
        """The shared decoder's config: sandwich norms with Gemma's (1 + w) offset, per-head QK-norm,
        sqrt(hidden) embedding scale, sliding layers on `rope_local_base_freq` unscaled."""
        c = self
        return DecoderConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_activation,
            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
            norm_placement="sandwich", norm_offset=True, attention_bias=c.attention_bias, qk_norm="head",
            rope_theta=c.rope_theta, local_rope_theta=c.rope_local_base_freq,
            rope_scaling=None if c.full_rope_factor == 1.0 else {"rope_type": "linear", "factor": c.full_rope_factor},
            layer_types=c.layer_types, sliding_window=c.sliding_window,
            final_logit_softcapping=c.final_logit_softcapping, query_scale=c.query_pre_attn_scalar**-0.5,
            embedding_scale=math.sqrt(c.hidden_size), float32_residual=True,
            bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)

    @classmethod
    def from_hf(cls, d):
        """From a Hugging Face config dict (config.json, or `model.config.to_dict()`)."""
        if not isinstance(d, dict):
            raise ValueError(f"Gemma3Config: expected a config dict (a JSON object), got {type(d).__name__}")
        d = dict(d)
        d.pop("text_config", None)
        rope = d.pop("rope_parameters", None)
        if rope is not None and not (isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values())):
            raise ValueError(f"rope_parameters={rope!r}; expected a dict of per-layer-type dicts")
        if rope:  # transformers >= 5 groups rope settings per layer type
            full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
            d.setdefault("rope_theta", full.get("rope_theta", cls.rope_theta))
            d.setdefault("rope_local_base_freq", local.get("rope_theta", cls.rope_local_base_freq))
            if full.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", {k: v for k, v in full.items() if k != "rope_theta"})
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"rope scaling on sliding layers is not supported: {local}")
        if d.get("sliding_window_pattern", 0) is None:
            d.pop("sliding_window_pattern")
        if isinstance(d.get("layer_types"), (list, tuple)) and "sliding_window_pattern" in d:
            pattern = cls(num_hidden_layers=len(d["layer_types"]),
                          sliding_window_pattern=d.pop("sliding_window_pattern")).layer_types
            if tuple(d["layer_types"]) != pattern:
                raise ValueError(f"layer_types {d['layer_types']} contradict sliding_window_pattern")
        return from_hf_dict(cls, d, must_be={"use_bidirectional_attention": False})


def _check_rope_scaling(scaling):
    """None, or {"rope_type": "linear" (or "default"), "factor": f > 0}: what the blocks implement."""
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in ("linear", "default"):
        raise ValueError(f"rope_scaling {scaling!r} is not supported (only linear)")
    factor = scaling.get("factor", 1.0)
    if kind == "linear" and not (type(factor) in (int, float) and 0 < factor < float("inf")):
        raise ValueError(f"rope_scaling factor {factor!r} must be a finite number > 0")
