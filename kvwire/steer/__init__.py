"""Control vectors: train from contrastive prompts; steer at a block site by adding (`Steer`),
projecting out (`Ablate`; `head_basis` for whole heads), clamping (`Clamp`), editing SAE features
(`SAEEdit`), gated by a `Probe`; GGUF interop; and `sweep` (a probe and a sample per strength)."""
from ..generate.causal_lm import register_steering
from .apply import ablate, add_vector, clamp
from .bake import bake_ablation, bake_steer
from .layer import Steer
from .ops import Ablate, Clamp
from .gate import Gate, Probe
from .heads import head_basis
from .sae import SAE, SAEEdit, steer_features
from .sweep import Sweep, WordGap, sweep
from .vector import ControlVector

register_steering(steer=add_vector, ablate=ablate, clamp=clamp, features=steer_features)

__all__ = ["Ablate", "Clamp", "bake_ablation", "bake_steer", "ControlVector", "Gate", "head_basis", "Probe", "SAE", "SAEEdit", "Steer", "steer_features", "Sweep", "WordGap", "sweep"]
