"""A probe that decides once per prompt (CAST's condition, arXiv 2409.05907): a state slot.

`PromptProbe` scores the mean of a row's prompt states at its site instead of each position's own
state, and generated tokens keep the prompt's decision. The running sum and count of the prompt's
states outlive a call, so the probe holds a *state slot* in the cached graph: it speaks the cache
protocol (`cache_spec`, `forward_cached(..., cache)`) with a pair (sum (B, 1, 1, D), count
(B, 1, 1, 1)) that does not grow with the timeline — a ring of one slot holding the value after the
row's last token, which is what the engine's copies, growth and prefix store already do right for a
ring: a stored state is reused only at the length it was stored at.

Per chunk, branch-free:
- a row whose chunk holds its first real token (position 0, not a pad) starts from zero (a row the
  engine gives to a new request), any other row from its state;
- real tokens at positions < `<name>_until` (the row's prompt length; runtime input, default: the
  prompt lengths the engine gives, else no end) add to the sum, in order (a running sum in the chunk);
- each position's score reads the running mean: a prompt position sees the prompt so far, a
  generated one the whole prompt (CAST reads the whole prompt at once; the running mean is its
  causal form, equal from the prompt's last token on, and what chunked prefill can reproduce).
"""
import torch

from ..layers.attention import functional_cache_writes
from ..layers.masks import per_row as per_row_index
from .gate import Probe
from .schedule import END


class PromptProbe(Probe):
    """A `Probe` read from the mean of each row's prompt states (see the module docstring).

    x (B, T, D) -> gate (B, T, 1). Runtime inputs: `<name>_threshold` (B,) float32 and
    `<name>_until` (B,) int64 (the first position that is not prompt). Plainly called it treats the
    whole input as prompt (a running mean over every position).

    Example:
        >>> probe = PromptProbe(torch.randn(640), threshold=0.2, kind="cosine")
        >>> probe(torch.randn(1, 5, 640)).shape
        torch.Size([1, 5, 1])
    """

    uses_positions = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime_inputs = {**self.runtime_inputs, f"{self.name}_until": torch.int64}

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        until = torch.full((batch_size,), END, dtype=torch.int64, device=self.threshold.device) \
            if prompt_lengths is None else \
            torch.as_tensor(prompt_lengths, dtype=torch.int64, device=self.threshold.device).reshape(batch_size)
        return {**super().runtime_defaults(batch_size), f"{self.name}_until": until}

    def cache_spec(self, batch_size, max_length, dtype):
        return (batch_size, 1, 1, self.direction.numel()), (batch_size, 1, 1, 1)

    def forward(self, x):
        B, T, _ = x.shape
        inputs = {k: v.to(x.device) for k, v in self.runtime_defaults(B).items()}
        cache = tuple(torch.zeros(s, device=x.device) for s in self.cache_spec(B, T, None))
        positions = torch.arange(T, device=x.device)[None].expand(B, T)
        index = torch.zeros((), dtype=torch.long, device=x.device)
        mask = torch.ones(B, T, dtype=torch.bool, device=x.device)
        return self.forward_cached(x, positions=positions, cache_index=index, attention_mask=mask, cache=cache,
                                   **inputs)[0]

    def forward_cached(self, x, *, positions, cache_index, attention_mask, cache, **inputs):
        """-> (gate (B, T, 1), next state (sum, count)); the state is updated in place in eager calls."""
        total, count = cache
        B, T, D = x.shape
        offsets = torch.arange(T, device=x.device)
        index = cache_index[:, None] + offsets if per_row_index(cache_index) else (cache_index + offsets)[None]
        real = attention_mask.gather(1, index.expand(B, T)).to(torch.float32)  # (B, T): not a pad
        fresh = (real * (positions == 0).to(torch.float32)).amax(dim=1)  # (B,): the row starts here
        keep = (1.0 - fresh)[:, None, None, None]
        until = inputs[f"{self.name}_until"]
        w = (real * (positions < until[:, None]).to(torch.float32))[..., None]  # (B, T, 1)
        sums = (total * keep).view(B, 1, D) + torch.cumsum(w * x.float(), dim=1)  # (B, T, D)
        counts = (count * keep).view(B, 1, 1) + torch.cumsum(w, dim=1)  # (B, T, 1)
        gate = self.gate_of(sums / counts.clamp_min(1.0), inputs)
        new = (sums[:, -1:].view(B, 1, 1, D), counts[:, -1:].view(B, 1, 1, 1))
        if functional_cache_writes():
            return gate, new
        total.copy_(new[0])  # in place, as cached attention writes its keys and values
        count.copy_(new[1])
        return gate, (total, count)
