"""Control vectors: train from contrastive prompts; steer at a block site by adding (`Steer`),
projecting out (`Ablate`) or clamping (`Clamp`); GGUF interop;
and `sweep` (a probe and a sample per strength)."""
from ..generate.causal_lm import register_steering
from .apply import ablate, add_vector, clamp
from .layer import Steer
from .ops import Ablate, Clamp
from .sweep import Sweep, WordGap, sweep
from .vector import ControlVector

register_steering(steer=add_vector, ablate=ablate, clamp=clamp)

__all__ = ["Ablate", "Clamp", "ControlVector", "Steer", "Sweep", "WordGap", "sweep"]
