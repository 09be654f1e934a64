"""The shared decoder's config: every choice a family makes is a field here.

Field names are Hugging Face's (Llama's where families differ). A family's HF mapping fills them;
the backbone reads nothing else.
"""
from dataclasses import dataclass

from ...layers.mlp import activation
from ...layers.rope_scaling import check_rope_scaling
from ..config import MAX_LAYERS, check_fields

LAYER_TYPES = ("full_attention", "sliding_attention")
# which of the block's four norm slots exist: before/after attention, before/after the MLP
NORM_PLACEMENTS = {
    "pre": ("input_layernorm", "pre_feedforward_layernorm"),  # Llama, Qwen, Mistral, Phi-3, Gemma, Granite
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),  # OLMo 2
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),  # Gemma 2 and 3
}
QK_NORMS = (None, "head", "full")
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "local_rope_theta",
             "sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "query_scale",
             "embedding_scale", "residual_multiplier", "logits_scaling", "partial_rotary_factor")


@dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of the shared decoder (`DecoderBackbone`).

    Sizes: `num_key_value_heads` defaults to the query heads, `head_dim` to hidden / heads.
    Norms: `norm_placement` "pre" | "post" | "sandwich" (see NORM_PLACEMENTS); `norm_offset`: RMSNorm
    scales by (1 + weight) (Gemma). Biases: `attention_bias` (q, k, v), `attention_out_bias` (o;
    None = attention_bias), `mlp_bias` (gate, up, down), `mlp_out_bias` (down, per layer: None =
    mlp_bias, a bool for every layer, or one bool per layer, as a GGUF whose baked steer gave only
    the steered blocks one; kept as a tuple). `qk_norm`: None, "head" or "full". Rotary: `rope_theta`,
    `rope_scaling` (transformers' dict: rope_type and its parameters), `partial_rotary_factor`;
    sliding layers use `local_rope_theta` unscaled when it is set (Gemma 3). `layer_types`: one of
    LAYER_TYPES per layer (None = all full); `sliding_window`: tokens a sliding layer's query sees,
    itself included. Multipliers: `query_scale` (of q.k; None = head_dim ** -0.5), `embedding_scale`
    (Gemma sqrt(hidden), Granite's embedding_multiplier), `residual_multiplier`, `logits_scaling`
    (logits are divided by it). `float32_residual`: float16 weights keep a float32 residual stream.

    Example:
        >>> DecoderConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...               num_attention_heads=4, num_key_value_heads=2).head_dim
        8
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = None
    head_dim: int = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    norm_placement: str = "pre"
    norm_offset: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = None
    mlp_bias: bool = False
    mlp_out_bias: tuple = None
    qk_norm: str = None
    rope_theta: float = 10_000.0
    rope_scaling: dict = None
    partial_rotary_factor: float = 1.0
    local_rope_theta: float = None
    layer_types: tuple = None
    sliding_window: int = None
    attn_logit_softcapping: float = None
    final_logit_softcapping: float = None
    query_scale: float = None
    embedding_scale: float = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    float32_residual: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int = None
    eos_token_id: object = None
    pad_token_id: int = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: defaults resolved once)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and type(self.hidden_size) is int and type(self.num_attention_heads) is int:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                                 f"{self.num_attention_heads}; give head_dim")
            set_("head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        if self.attention_out_bias is None:
            set_("attention_out_bias", self.attention_bias)
        check_fields(self, _POSITIVE, layers="num_hidden_layers")
        set_("mlp_out_bias", _per_layer_bias(self.mlp_bias if self.mlp_out_bias is None else self.mlp_out_bias,
                                             self.num_hidden_layers))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.rms_norm_eps < 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps}; expected a value >= 0")
        activation(self.hidden_act)  # raises on an unknown name
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement={self.norm_placement!r}; expected one of {sorted(NORM_PLACEMENTS)}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r}; expected one of {QK_NORMS}")
        types = ("full_attention",) * self.num_hidden_layers if self.layer_types is None else self.layer_types
        if not isinstance(types, (list, tuple)) or len(types) != self.num_hidden_layers or \
                not all(isinstance(t, str) and t in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must list {self.num_hidden_layers} entries (one per layer) from "
                             f"{LAYER_TYPES}; got {types!r}")
        set_("layer_types", tuple(types))
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} rotates {self.rotary_dim} of "
                             f"{self.head_dim} head dims; expected an even number > 0 and a factor in (0, 1]")
        set_("rope_scaling", check_rope_scaling(self.rope_scaling, rotary_dim=self.rotary_dim))

    @property
    def rotary_dim(self):
        """Leading dims of each head that rotate (Phi-3's partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)


def _per_layer_bias(value, n_layers):
    """mlp_out_bias as one bool per layer, from a bool or a list of them."""
    flags = (value,) * n_layers if type(value) is bool else value
    if not isinstance(flags, (list, tuple)) or len(flags) != n_layers or not all(type(b) is bool for b in flags):
        raise ValueError(f"mlp_out_bias={value!r}; expected true, false or {n_layers} of them (one per layer)")
    return tuple(flags)


def sliding_layer_types(n_layers, *, full_every=None, first_sliding=0):
    """`layer_types` of a window pattern: layers from `first_sliding` on slide (Qwen's
    max_window_layers), except every `full_every`-th, which is full (Gemma 2: 2, Gemma 3: 6).

    Example:
        >>> sliding_layer_types(4, full_every=2)
        ('sliding_attention', 'full_attention', 'sliding_attention', 'full_attention')
    """
    if not (type(n_layers) is int and 0 <= n_layers <= MAX_LAYERS):  # a corrupt count must not build a huge list
        raise ValueError(f"num_hidden_layers={n_layers!r}; expected an integer in [0, {MAX_LAYERS}]")
    if full_every is not None and not (type(full_every) is int and full_every >= 1):
        raise ValueError(f"full_every={full_every!r}; expected an integer >= 1")
    if not (type(first_sliding) is int and first_sliding >= 0):
        raise ValueError(f"first_sliding={first_sliding!r}; expected an integer >= 0")
    return tuple("full_attention" if i < first_sliding or (full_every and (i + 1) % full_every == 0)
                 else "sliding_attention" for i in range(n_layers))
