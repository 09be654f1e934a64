"""The generation loop: one prefill call and T=1 decode calls of the same cached graph."""
import time
from dataclasses import dataclass

import torch


@dataclass
class Generation:
    """Generated ids per row (prompt excluded, stop token excluded) and timings."""

    tokens: list
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int

    @property
    def decode_tokens_per_second(self):
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def left_pad(rows, pad_id=0):
    """Token id rows of different lengths -> ids (B, L), positions (B, L), pad counts (B,)."""
    L = max(len(r) for r in rows)
    pads = torch.tensor([L - len(r) for r in rows])
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.as_tensor(r, dtype=torch.long)
    positions = (torch.arange(L)[None] - pads[:, None]).clamp(min=0)
    return ids, positions, pads


@torch.inference_mode()
def greedy(cached, head, rows, max_new_tokens, eos_ids=(), pad_id=0):
    """Greedy decoding of a batch of prompts through a `CachedGraph` and a head.

    rows: list of token-id lists (left-padded here). Each row stops at its first EOS (not returned)
    or after `max_new_tokens`. The cache is sized prompt + max_new_tokens.
    """
    ids, positions, pads = left_pad(rows, pad_id)
    B, L = ids.shape
    max_length = L + max_new_tokens
    mask = torch.arange(max_length)[None] >= pads[:, None]  # (B, max_length): left pads invalid
    cache = cached.init_cache(B, max_length)
    eos = torch.tensor(list(eos_ids) or [-1])
    start = time.perf_counter()
    hidden, cache = cached(ids, positions, 0, mask, cache)
    token = head(hidden[:, -1]).argmax(-1)
    prefill = time.perf_counter() - start
    out, done = [[] for _ in range(B)], torch.zeros(B, dtype=torch.bool)
    start, steps = time.perf_counter(), 0
    for step in range(max_new_tokens):
        done |= torch.isin(token, eos)
        for i in range(B):
            if not done[i]:
                out[i].append(int(token[i]))
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        index = L + step
        hidden, cache = cached(token[:, None], (index - pads)[:, None], index, mask, cache)
        token = head(hidden[:, -1]).argmax(-1)
        steps += 1
    return Generation(out, prefill, time.perf_counter() - start, steps)
