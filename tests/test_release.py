"""Graph modules kvwire makes give back torch.fx's copy of their generated source when collected:
a steered copy per request must not grow memory (bench/long_run.py --steer-each-call measures it)."""
import gc
import linecache

import torch

import kvwire as kw
from kvwire.graph.release import _source_key, kept_source_bytes

from .conftest import FAMILIES

IDS = torch.tensor([[3, 17, 42, 9]])


def test_collected_copies_leave_no_generated_source_behind():
    lm = kw.from_hf(FAMILIES["gemma3"]())
    vec = kw.ControlVector({1: torch.ones(lm.head.weight.shape[1])})
    lm.steer(vec, 0.5).generate(IDS, max_new_tokens=2)
    gc.collect()
    before = kept_source_bytes()
    for strength in range(12):
        lm.steer(vec, float(strength)).edit(kw.skip("layers.2")).generate(IDS, max_new_tokens=2)
    gc.collect()
    assert kept_source_bytes() == before  # was ~7 kB more per copy
    live = lm.steer(vec, 1.0)
    live.generate(IDS, max_new_tokens=2)
    assert kept_source_bytes() > before
    key = _source_key(live.cached.graph_module)
    assert key is not None and "forward_cached" in "".join(linecache.getlines(key))  # tracebacks still read it
