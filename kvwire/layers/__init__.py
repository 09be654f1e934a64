"""Primitive layers and the cache/position protocol (see `base`)."""
from .attention import Attention
from .base import Block, Layer
from .embedding import PositionEmbedding, TokenEmbedding
from .head import OutputWeight, TiedHead
from .mlp import MLP, GatedMLP
from .norm import LayerNorm, RMSNorm
from .rotary import Rotary
from .site import SITES, Site

__all__ = ["Attention", "Block", "Layer", "PositionEmbedding", "TokenEmbedding", "MLP", "GatedMLP",
           "LayerNorm", "RMSNorm", "OutputWeight", "Rotary", "SITES", "Site", "TiedHead"]
