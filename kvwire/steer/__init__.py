"""Control vectors: train from contrastive prompts, steer through a `Steer` layer, GGUF interop,
and `sweep` (a probe and a sample per strength)."""
from ..generate.causal_lm import register_steering
from .apply import add_vector
from .layer import Steer
from .sweep import Sweep, WordGap, sweep
from .vector import ControlVector

register_steering(add_vector)

__all__ = ["ControlVector", "Steer", "Sweep", "WordGap", "sweep"]
