"""Control vectors: train from contrastive prompts; steer at a block site by adding (`Steer`),
projecting out (`Ablate`; `head_basis` for whole heads), clamping (`Clamp`), editing SAE features
(`SAEEdit`), gated by a `Probe`; GGUF interop; `sweep` (a probe and a sample per strength); and
measuring them: `evaluate` (A/B logit difference, steerability, side effects) and `calibrate`."""
from ..generate.causal_lm import register_steering
from .apply import ablate, add_vector, clamp
from .bake import bake_ablation, bake_steer
from .calibrate import Calibration, calibrate
from .dataset import ABDataset, dataset, neutral_text
from .evaluate import Evaluation, evaluate
from .layer import Steer
from .operation import Operation
from .ops import Ablate, Clamp
from .gate import Gate, Probe
from .heads import head_basis
from .sae import SAE, SAEEdit, steer_features
from .sweep import Sweep, WordGap, sweep
from .vector import ControlVector

register_steering(steer=add_vector, ablate=ablate, clamp=clamp, features=steer_features)

__all__ = ["ABDataset", "Ablate", "calibrate", "Calibration", "dataset", "evaluate", "Evaluation", "neutral_text", "Operation", "Clamp", "bake_ablation", "bake_steer", "ControlVector", "Gate", "head_basis", "Probe", "SAE", "SAEEdit", "Steer", "steer_features", "Sweep", "WordGap", "sweep"]
