"""`Steer`: the layer a control vector inserts after a decoder block: x + strength * direction."""
import torch

from ..layers.base import Layer


class Steer(Layer):
    """Adds `strength * direction` to every position's hidden state (the arXiv 2310.01405 edit).

    Args:
        direction: (D,) float tensor (stored float32, added in the hidden states' dtype).
        strength: a number, or a (B,) tensor giving each batch row its own strength.
        generated_only: in cached generation, leave the prompt's positions as they are and steer
            only tokens the model generates (positions >= the row's prompt length).
        name: prefix of the cached graph's runtime inputs `<name>_strength` (B,) float32 and
            `<name>_start` (B,) int64 (first steered position); layers sharing a name share them.
        device: where direction and strength are kept (default: the direction's own device, the
            CPU for a list); `lm.steer` passes the model's. The defaults it gives are made there.

    Plainly called (no cache) it steers every position with its own strength. In a cached graph
    the strength and start are graph inputs, so exported models take them at run time.

    Example:
        >>> steer = Steer(torch.randn(640), strength=4.0)
        >>> steer(torch.zeros(1, 3, 640)).shape
        torch.Size([1, 3, 640])
    """

    uses_positions = True

    def __init__(self, direction, strength=1.0, generated_only=False, name="steer", device=None):
        super().__init__()
        if device is None:
            device = direction.device if isinstance(direction, torch.Tensor) else torch.device("cpu")
        direction = torch.as_tensor(direction, dtype=torch.float32, device=device)
        if direction.dim() != 1:
            raise ValueError(f"direction must be 1-D (D,), got shape {tuple(direction.shape)}")
        strength = torch.as_tensor(strength, dtype=torch.float32, device=device)
        if strength.dim() > 1:
            raise ValueError(f"strength must be a number or a (B,) tensor, got shape {tuple(strength.shape)}")
        self.register_buffer("direction", direction)
        self.register_buffer("strength", strength)
        self.generated_only = bool(generated_only)
        self.name = name
        self.runtime_inputs = {f"{name}_strength": torch.float32, f"{name}_start": torch.int64}

    def extra_repr(self):
        return f"width={self.direction.numel()}, strength={self.strength.tolist()}, " \
               f"generated_only={self.generated_only}, name={self.name!r}"

    def forward(self, x):
        """x (B, T, D) -> x + strength * direction."""
        rows = self.strength.numel()
        if self.strength.dim() == 1 and rows not in (1, x.shape[0]):  # as runtime_defaults: (1,) fits any
            raise ValueError(f"steering strength has {rows} rows (one per prompt) but the batch has "
                             f"{x.shape[0]}; steer with a single number for other batch sizes")
        return x + (self.strength.reshape(-1, 1, 1) * self.direction).to(x.dtype)

    def same_inputs(self, other):
        """Whether `other` reads the same runtime inputs with the same defaults (may share them)."""
        return self.name == other.name and self.generated_only == other.generated_only \
            and self.strength.shape == other.strength.shape and torch.equal(self.strength, other.strength)

    def forward_cached(self, x, *, positions, **inputs):
        strength, start = inputs[f"{self.name}_strength"], inputs[f"{self.name}_start"]
        on = (positions >= start[:, None]).to(torch.float32)  # (B, T)
        shift = (strength[:, None] * on)[..., None] * self.direction  # (B, T, D)
        return x + shift.to(x.dtype)

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        strength = self.strength.reshape(-1)
        if strength.numel() == 1:
            strength = strength.expand(batch_size)
        elif strength.numel() != batch_size:
            raise ValueError(f"steering strength has {strength.numel()} rows but the batch has {batch_size}; "
                             f"give one strength per prompt or a single number")
        device = self.strength.device
        if self.generated_only and prompt_lengths is not None:
            start = torch.as_tensor(prompt_lengths, dtype=torch.int64, device=device).reshape(batch_size)
        else:
            start = torch.zeros(batch_size, dtype=torch.int64, device=device)
        return {f"{self.name}_strength": strength.clone(), f"{self.name}_start": start}
