"""`Steer`: the layer a control vector inserts at a site: x + strength * direction."""
import torch

from .schedule import Scheduled, per_row, strength_tensor


def as_vector(direction, device, what="direction"):
    """A (D,) float32 tensor on `device` (the direction's own device, the CPU for a list, if None),
    checked where it was given (a model on the meta device gets unchecked meta copies)."""
    given = direction.device if isinstance(direction, torch.Tensor) else torch.device("cpu")
    source = torch.as_tensor(direction, dtype=torch.float32, device=given)  # not the default device
    if source.dim() != 1:
        raise ValueError(f"{what} must be 1-D (D,), got shape {tuple(source.shape)}")
    if source.device.type != "meta" and not torch.isfinite(source).all():
        raise ValueError(f"{what} holds NaN or infinite values")
    return source.to(source.device if device is None else device)


class Steer(Scheduled):
    """Adds `strength * direction` to every scheduled position's hidden state (arXiv 2310.01405).

    Args:
        direction: (D,) float tensor (stored float32, added in the hidden states' dtype).
        strength: a number, or a (B,) tensor giving each batch row its own strength.
        generated_only: shorthand for when="generated": in cached generation, leave the prompt's
            positions as they are and steer only tokens the model generates.
        name: prefix of the cached graph's runtime inputs `<name>_strength` (B,) float32 and
            `<name>_start`, `<name>_end` (B,) int64 (the steered positions); layers sharing a name
            share them.
        device: where direction and strength are kept (default: the direction's own device, the
            CPU for a list); `lm.steer` passes the model's. The defaults it gives are made there.
        when: the positions steered (see `kvwire.steer.schedule`): "all", "prompt", "generated",
            k or (k0, k1).

    Plainly called (no cache) it steers every position with its own strength. In a cached graph
    the strength and schedule are graph inputs, so exported models take them at run time.

    Example:
        >>> steer = Steer(torch.randn(640), strength=4.0)
        >>> steer(torch.zeros(1, 3, 640)).shape
        torch.Size([1, 3, 640])
    """

    def __init__(self, direction, strength=1.0, generated_only=False, name="steer", device=None, when=None):
        if generated_only and when not in (None, "generated"):
            raise ValueError(f"generated_only=True is when='generated'; got when={when!r} as well")
        super().__init__(name, "generated" if generated_only else when)
        direction = as_vector(direction, device)
        self.register_buffer("direction", direction)
        self.register_buffer("strength", strength_tensor(strength, direction.device))

    scale_input = "strength"  # `on` comes scaled by each row's strength

    @property
    def generated_only(self):
        return self.when == "generated"

    def extra_repr(self):
        return f"width={self.direction.numel()}, strength={self.strength.tolist()}, " \
               f"when={self.when!r}, name={self.name!r}"

    def own_inputs(self):
        return {f"{self.name}_strength": torch.float32}

    def own_defaults(self, batch_size):
        return {f"{self.name}_strength": per_row(self.strength, batch_size, "steering strength")}

    def forward(self, x, gate=None):
        """x (B, T, D) -> x + strength * direction (times `gate` (B, T, 1) where one is given)."""
        rows = self.strength.numel()
        if self.strength.dim() == 1 and rows not in (1, x.shape[0]):  # as runtime_defaults: (1,) fits any
            raise ValueError(f"steering strength has {rows} rows (one per prompt) but the batch has "
                             f"{x.shape[0]}; steer with a single number for other batch sizes")
        return super().forward(x, gate)

    def act(self, x, on, inputs):
        if x.dtype == torch.float32:
            return torch.addcmul(x, on, self.direction)  # x + strength * direction where scheduled, one op
        return x + (on * self.direction).to(x.dtype)  # (B, T, D) float32, cast once
