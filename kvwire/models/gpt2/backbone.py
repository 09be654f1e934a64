"""GPT-2 backbone, written once and without cache code. Module names follow the HF checkpoint."""
from torch import nn

from ...layers import MLP, Attention, Block, LayerNorm, PositionEmbedding, TokenEmbedding


class GPT2Block(Block):
    """Pre-norm attention and MLP with residuals. x (B, T, D) -> (B, T, D)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        head_dim = c.n_embd // c.n_head
        self.ln_1 = LayerNorm(c.n_embd, c.layer_norm_epsilon)
        self.attn = Attention(c.n_embd, c.n_head, c.n_head, head_dim, bias=True,
                              scale=head_dim**-0.5 if c.scale_attn_weights else 1.0)
        self.ln_2 = LayerNorm(c.n_embd, c.layer_norm_epsilon)
        self.mlp = MLP(c.n_embd, c.inner_size, c.activation_function)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Backbone(nn.Module):
    """token_ids (B, T) -> hidden states (B, T, D) after the final LayerNorm.

    Example:
        >>> backbone = GPT2Backbone(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100))
        >>> backbone(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 32])
    """

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
        self.config = config
        self.wte = TokenEmbedding(config.vocab_size, config.n_embd)
        self.wpe = PositionEmbedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)

    def forward(self, token_ids):
        x = self.wpe(self.wte(token_ids))  # wpe adds the learned position vectors
        for block in self.h:
            x = block(x)
        return self.ln_f(x)
