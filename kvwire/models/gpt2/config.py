"""GPT-2 config, with Hugging Face field names."""
from dataclasses import dataclass

from ..config import check_fields, from_hf_dict

_POSITIVE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyper-parameters (HF names). `n_inner` None means 4 * n_embd."""

    vocab_size: int = 50_257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    bos_token_id: int = 50_256
    eos_token_id: object = 50_256
    pad_token_id: int = None

    def __post_init__(self):
        check_fields(self, _POSITIVE, layers="n_layer")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if self.layer_norm_epsilon < 0:
            raise ValueError(f"layer_norm_epsilon={self.layer_norm_epsilon}; expected a value >= 0")

    @property
    def hidden_size(self):
        return self.n_embd

    @property
    def max_position_embeddings(self):
        return self.n_positions

    @property
    def inner_size(self):
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_hf(cls, d):
        """From a Hugging Face config dict (config.json, or `model.config.to_dict()`)."""
        return from_hf_dict(cls, d, must_be={"scale_attn_by_inverse_layer_idx": False,
                                             "reorder_and_upcast_attn": False, "add_cross_attention": False})
