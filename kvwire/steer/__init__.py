"""Control vectors: train from contrastive prompts, steer through a `Steer` layer, GGUF interop."""
from .layer import Steer
from .vector import ControlVector

__all__ = ["ControlVector", "Steer"]
