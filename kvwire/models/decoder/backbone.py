"""The shared decoder: one block and one backbone for every Llama-like family, written once and
without cache code. What differs between families is `DecoderConfig` data.

Module names follow Hugging Face checkpoints (`embed_tokens`, `layers.N.self_attn.q_proj`,
`mlp.gate_proj`, `norm`, `lm_head`). A block has up to four norms, named as Gemma 2/3 name them:
`input_layernorm` (before attention), `post_attention_layernorm` (after it),
`pre_feedforward_layernorm` (before the MLP), `post_feedforward_layernorm` (after it). Llama's
checkpoints call their pre-MLP norm `post_attention_layernorm`; its converter renames it.
"""
from functools import partial

from torch import nn

from ...layers import Attention, Block, GatedMLP, OutputWeight, RMSNorm, Rotary, TiedHead, TokenEmbedding
from ...layers.site import add_sites
from .config import NORM_PLACEMENTS


class DecoderBlock(Block):
    """Attention and a gated MLP with residuals, norms where the config puts them.
    x (B, T, D) -> (B, T, D). Its named sites are `kvwire.layers.site.SITES`."""

    def __init__(self, config, layer_idx):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        sliding = c.layer_types[layer_idx] == "sliding_attention"
        self.self_attn = Attention(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, scale=c.query_scale,
            bias=c.attention_bias, o_bias=c.attention_out_bias, rotary=_rotary(c, sliding),
            qk_norm=partial(RMSNorm, eps=c.rms_norm_eps, offset=c.norm_offset) if c.qk_norm else None,
            qk_norm_width=c.qk_norm or "head", sliding_window=c.sliding_window if sliding else None,
            softcap=c.attn_logit_softcapping)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias,
                            out_bias=c.mlp_out_bias[layer_idx])
        for name in NORM_PLACEMENTS[c.norm_placement]:
            setattr(self, name, RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.norm_offset))
        self.residual_multiplier = c.residual_multiplier
        add_sites(self)

    def forward(self, x):
        x = self.resid_pre(x)
        a = self.self_attn(self._norm("input_layernorm", x))
        x = self.resid_mid(x + self.attn_out(self._scaled(self._norm("post_attention_layernorm", a))))
        h = self.mlp(self._norm("pre_feedforward_layernorm", x))
        return self.block_out(x + self.mlp_out(self._scaled(self._norm("post_feedforward_layernorm", h))))

    def _norm(self, name, x):
        norm = getattr(self, name, None)  # a slot this placement leaves empty passes x through
        return x if norm is None else norm(x)

    def _scaled(self, h):
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


def _rotary(c, sliding):
    """Sliding layers use `local_rope_theta` unscaled when the config sets it (Gemma 3)."""
    if sliding and c.local_rope_theta is not None:
        return Rotary(c.head_dim, c.local_rope_theta, rotary_dim=c.rotary_dim)
    return Rotary(c.head_dim, c.rope_theta, c.rope_scaling, rotary_dim=c.rotary_dim,
                  max_position_embeddings=c.max_position_embeddings)


class DecoderBackbone(nn.Module):
    """token_ids (B, T) -> hidden states (B, T, D) after the final norm.

    An untied checkpoint's output matrix lives here as `lm_head` (read by the head, never by this
    forward), so the backbone's state dict is the whole checkpoint.

    Example:
        >>> config = DecoderConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
        ...                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> DecoderBackbone(config)(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 32])
    """

    def __init__(self, config):
        super().__init__()
        c = self.config = config
        # Gemma's residual stream outgrows float16 (65504 after block 7 of Gemma 3 270M): with
        # float16 weights it stays float32 between blocks; norms hand the layers their own dtype
        self.embed_tokens = TokenEmbedding(c.vocab_size, c.hidden_size, scale=c.embedding_scale,
                                           float32_for_float16=c.float32_residual)
        self.layers = nn.ModuleList(DecoderBlock(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.norm_offset)
        if not c.tie_word_embeddings:
            self.lm_head = OutputWeight(c.vocab_size, c.hidden_size)

    def forward(self, token_ids):
        x = self.embed_tokens(token_ids)
        for block in self.layers:
            x = block(x)
        return self.norm(x)


def decoder_head(backbone):
    """The logits head of a `DecoderBackbone`: tied to the embedding or reading `lm_head`."""
    c = backbone.config
    owner = backbone.embed_tokens if c.tie_word_embeddings else backbone.lm_head
    return TiedHead(owner, c.final_logit_softcapping, None if c.logits_scaling == 1.0 else c.logits_scaling)
