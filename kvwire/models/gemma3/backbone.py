"""Gemma 3 backbone, written once and without cache code. Module names follow the HF checkpoint."""
from functools import partial

from torch import nn

from ...layers import Attention, Block, GatedMLP, RMSNorm, Rotary, TokenEmbedding
from ...layers.embedding import gemma_embed_scale


class Gemma3Block(Block):
    """Pre- and post-norm around attention and the gated MLP. x (B, T, D) -> (B, T, D)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        sliding = c.layer_types[layer_idx] == "sliding_attention"
        rotary = Rotary(c.head_dim, c.rope_local_base_freq) if sliding else \
            Rotary(c.head_dim, c.rope_theta, c.full_rope_factor)
        self.self_attn = Attention(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            scale=c.query_pre_attn_scalar**-0.5, bias=c.attention_bias, rotary=rotary,
            qk_norm=partial(RMSNorm, eps=c.rms_norm_eps), sliding_window=c.sliding_window if sliding else None)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_activation)
        norm = partial(RMSNorm, c.hidden_size, c.rms_norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Backbone(nn.Module):
    """token_ids (B, T) -> hidden states (B, T, D) after the final norm.

    Example:
        >>> backbone = Gemma3Backbone(Gemma3Config(num_hidden_layers=2, vocab_size=100, hidden_size=32))
        >>> backbone(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 32])
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        # Gemma's residual stream outgrows float16 (65504 after block 7 of the 270M model): with
        # float16 weights it stays float32 between blocks; norms hand the layers their own dtype
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.hidden_size,
                                           scale=gemma_embed_scale(config.hidden_size), float32_for_float16=True)
        self.layers = nn.ModuleList(Gemma3Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, token_ids):
        x = self.embed_tokens(token_ids)
        for block in self.layers:
            x = block(x)
        return self.norm(x)

