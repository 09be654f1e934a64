"""Sites inside a leaf layer: places a graph edit cannot reach because the layer is one call.

Attention is one call of the layer graph (it owns a cache), yet its per-head outputs, the input of
its output projection, are a site people edit (head ablation, per-head steering). A transformers
decoder layer on the generic path is one call as a whole, yet has the residual sites of any block.
Such a leaf lists the sites it holds in `inner_sites` and applies, at each, the chain of layers put
there (`with_edit` returns a copy of the leaf with one more layer in a site's chain: the weights
stay shared, the original leaf is untouched). The chains' runtime inputs become the leaf's own, so
the cache pass hands them over with the leaf's other arguments and the leaf passes them on.
"""
import copy

from torch import nn

from .base import Layer


class InnerSites:
    """Mixin for a `Layer` that is one graph call and holds named sites inside it.

    Subclasses set `inner_sites` (names) and call `edit_at(site, x, positions, inputs)` where each
    site's value is computed; `site_width(site)` gives the width D of the value there.
    """

    inner_sites = ()

    @property
    def edits(self):
        """{site: nn.Sequential of the layers put there, in order} ({} for a bare leaf)."""
        return self._modules.get("edits") or {}

    def with_edit(self, site, layer, gated=False):
        """A copy of this leaf (same weights, same submodules) whose `site` chain ends with `layer`;
        gated: `layer` also takes the gate the leaf is called with (its second input, (B, T, 1)).

        Example:
            >>> attn2 = attn.with_edit("attn_heads", kw.Ablate(head_rows))
        """
        if site not in self.inner_sites:
            raise ValueError(f"{type(self).__name__} has no inner site {site!r}; its inner sites are "
                             f"{list(self.inner_sites) or 'none'}")
        if gated and getattr(self, "gate_name", None) not in (None, gated):
            raise ValueError(f"{type(self).__name__} already holds operations gated by {self.gate_name!r}; one "
                             f"layer's inner operations take one gate, got {gated!r} as well")
        new = copy.copy(self)
        if gated:
            new.gate_name = gated
            layer.takes_gate = True
        new._modules = dict(self._modules)  # a copy shares the children, not the dict that lists them
        chains = {name: list(chain) for name, chain in self.edits.items()}
        chains.setdefault(site, []).append(layer)
        new._modules["edits"] = nn.ModuleDict({name: nn.Sequential(*chain) for name, chain in chains.items()})
        return new

    @property
    def runtime_inputs(self):
        return {name: dtype for chain in self.edits.values() for layer in chain
                for name, dtype in getattr(layer, "runtime_inputs", {}).items()}

    def runtime_defaults(self, batch_size, prompt_lengths=None):
        values = {}
        for chain in self.edits.values():
            for layer in chain:
                if getattr(layer, "runtime_inputs", None):
                    values.update(layer.runtime_defaults(batch_size, prompt_lengths))
        return values

    def edit_at(self, site, x, positions=None, inputs=None, gate=None):
        """x (B, T, D) at `site` -> x through the site's chain: plainly (each layer's own defaults)
        when positions is None, else through each layer's `forward_cached` with its runtime inputs
        taken from `inputs`; layers put there gated also take `gate` (B, T, 1)."""
        if site not in self.edits:
            return x
        for layer in self.edits[site]:
            wanted = getattr(layer, "runtime_inputs", {})
            given = (gate,) if getattr(layer, "takes_gate", False) else ()
            if positions is None or not (wanted or getattr(layer, "uses_positions", False)):
                x = layer(x, *given)
            else:
                x = layer.forward_cached(x, *given, positions=positions, **{name: inputs[name] for name in wanted})
        return x

    def site_width(self, site):
        """The width D of the value at `site` (what a direction put there must have)."""
        raise NotImplementedError


class Record(Layer):
    """Identity `x (B, T, D) -> x` that keeps the last value it saw in `seen`: reads a site inside a
    one-call layer (`InnerSites.with_edit(site, Record())`) in eager calls.

    Example:
        >>> rec = Record()
        >>> _ = rec(torch.ones(1, 2, 3)); rec.seen.shape
        torch.Size([1, 2, 3])
    """

    def __init__(self):
        super().__init__()
        self.seen = None

    def forward(self, x):
        self.seen = x
        return x
