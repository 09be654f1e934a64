"""Control vectors: train from contrastive prompts, steer through a `Steer` layer, GGUF interop,
and `sweep` (a probe and a sample per strength)."""
from .layer import Steer
from .sweep import Sweep, WordGap, sweep
from .vector import ControlVector

__all__ = ["ControlVector", "Steer", "Sweep", "WordGap", "sweep"]
