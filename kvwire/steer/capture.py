"""`lm.capture`: activations at named sites (the names edits and steering use) for every prompt and
position, read in one cached, batched run of the model's own graph.

A graph site (`layers.N.attn_out`, a generic block's `block_out`) is read by `kw.tap`; a site inside
a one-call layer (`attn_heads` inside attention, a generic block's residual sites) by a `Record` put
there (`kvwire.graph.sites.put_inside`). On a steered model the value read is the one after the
steering already at the site: what the rest of the model sees.
"""
from dataclasses import dataclass

import torch

from ..generate.causal_lm import register_steering
from ..generate.session import left_pad
from ..graph import clone, numbered_blocks, tap, with_cache
from ..graph.sites import put_inside, site_targets
from ..layers.inner import Record
from ..layers.site import ALL_SITES
from .turns import turn
from .vector import parse_layers


@dataclass(frozen=True)
class Capture:
    """What `capture` read: `values[(site, block)]` (B, T, D) float32 on the CPU, prompts left-padded
    to the longest (T); `mask` (B, T) bool is True at each prompt's own tokens (pad positions hold
    zeros); `tokens[i]` prompt i's token ids (its length T_i: its tokens are the last T_i positions).

    Example:
        >>> cap = lm.capture(["Hi there", "Bye"], sites="block_out", layers=[2])
        >>> cap[("block_out", 2)].shape, cap.row(1)[("block_out", 2)].shape
        (torch.Size([2, 3, 640]), torch.Size([2, 640]))
    """

    values: dict
    mask: torch.Tensor
    tokens: list

    def __getitem__(self, key):
        if key not in self.values:
            raise KeyError(f"{key!r} was not captured; captured (site, block) pairs: {list(self.values)}")
        return self.values[key]

    def __iter__(self):
        return iter(self.values)

    def __len__(self):
        return len(self.values)

    def keys(self):
        return self.values.keys()

    def items(self):
        return self.values.items()

    def row(self, i):
        """Prompt i's activations without its pads: {(site, block): (T_i, D)}."""
        n = len(self.tokens[i])
        return {key: value[i, value.shape[1] - n:] for key, value in self.values.items()}


def site_reads(lm, sites, layers):
    """(sites, blocks, {(site, block): call or (call, "inner")}) checked against the model: where each
    site of each block is read (after what is chained there already). Errors name the site or block."""
    sites = [sites] if isinstance(sites, str) else list(sites)
    if not sites:
        raise ValueError(f"sites is empty; expected one or more of {list(ALL_SITES)}")
    bad = [s for s in sites if s not in ALL_SITES]
    if bad:
        raise ValueError(f"sites {bad} are not sites; expected names from {list(ALL_SITES)}")
    blocks = numbered_blocks(lm.backbone)
    picked = sorted(blocks) if layers is None else parse_layers(layers, blocks)
    reads = {}
    for site in dict.fromkeys(sites):
        depth, calls = site_targets(lm.backbone, site, picked, "layer")
        for block in picked:
            reads[(site, block)] = (calls[block][0], "inner") if depth == "inner" else calls[block][0]
    return list(dict.fromkeys(sites)), picked, reads


def token_rows(lm, prompts, what="prompts"):
    """Token-id lists from a str, a list of str or of id lists, or a (B, T) int tensor; each checked."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise ValueError(f"{what} as a tensor must be (B, T) token ids, got {tuple(prompts.shape)} "
                             f"{prompts.dtype}")
        prompts = prompts.tolist()
    elif isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                      and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
        prompts = [prompts]  # one prompt: a text or one id list
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{what} must be a str, a list of str or token-id lists, or a (B, T) tensor; "
                         f"got {prompts!r:.60}")
    rows = []
    for i, p in enumerate(prompts):
        row = lm.encode(p) if isinstance(p, str) else list(p)
        if not row or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < lm.vocab_size
                              for t in row):
            raise ValueError(f"{what}[{i}] must be a non-empty str or list of token ids in [0, {lm.vocab_size}), "
                             f"got {p!r:.60}")
        lm.check_length(len(row), f"{what}[{i}]")
        rows.append(row)
    return rows


def capture(lm, prompts, sites="block_out", layers=None, batch_size=8):
    """Activations of `lm` at `sites` of blocks `layers` for each prompt and position.

    Args:
        prompts: a str, a list of str, a list of token-id lists, or a (B, T) int tensor.
        sites: a site name or a list of them (`kvwire.layers.site.ALL_SITES`).
        layers: block indices (a list, "A-B"), None: every block.
        batch_size: prompts per run of the cached graph (pads masked out of attention).
    Returns a `Capture`: `values[(site, block)]` (B, T, D) float32, left-padded, pads zeroed and
    marked by `mask` (B, T); D is the hidden size, or heads x head size at "attn_heads".

    Example:
        >>> cap = kw.capture(lm, ["The cat", "A dog sat"], sites=["attn_out", "attn_heads"], layers="1-2")
        >>> cap[("attn_heads", 1)].shape       # gemma3-270m: BOS + 3 tokens, 4 heads of 256
        torch.Size([2, 4, 1024])
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    rows = token_rows(lm, prompts)
    return read_sites(lm, rows, site_reads(lm, sites, layers)[2], batch_size)


def read_sites(lm, rows, reads, batch_size=8):
    """`capture` of token-id `rows` at `reads` (from `site_reads`), unchecked."""
    calls = sorted({r for r in reads.values() if isinstance(r, str)})
    inner = {key: r[0] for key, r in reads.items() if not isinstance(r, str)}
    module, records = lm.backbone, {}
    if inner:
        module = clone(lm.backbone, depth="layer")
        for key, call in inner.items():
            records[key] = Record()
            put_inside(module, key[0], {call: records[key]})
    cached = with_cache(tap(module, calls, depth="layer") if calls else module)
    ids, positions, pads = left_pad(rows, device=lm.device)
    mask = torch.arange(ids.shape[1], device=lm.device)[None] >= pads[:, None]  # (B, T)
    parts = {key: [] for key in reads}
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            if start:
                turn()  # others may run between calls (`kvwire.steer.turns`)
            part = slice(start, start + batch_size)
            cache = cached.init_cache(ids[part].shape[0], ids.shape[1])
            result, _ = cached(ids[part], positions[part], 0, mask[part], cache)
            taps = result[1] if calls else {}
            for key, read in reads.items():
                value = records[key].seen if key in records else taps[read]
                parts[key].append(torch.where(mask[part, :, None], value.float(), 0.0).cpu())
    return Capture({key: torch.cat(p) for key, p in parts.items()}, mask.cpu(), rows)


register_steering(capture=capture)
