"""Redraw the README's pictures under docs/ (Graphviz's `dot` needed):

    python examples/draw_docs.py

- docs/gemma3_before.svg, docs/gemma3_steered.svg: the default model's layer graph, plain and
  steered by examples/data/happy.gguf (what `kvwire plot OUT --control-vector ...` draws);
- docs/cached_steered_tiny.svg: the cached graph of a steered 2-block Gemma 3 with random weights,
  where each layer's cache inputs and outputs and the runtime inputs are visible.
"""
from pathlib import Path

import torch

import kvwire as kw
from kvwire.generate import CausalLM
from kvwire.models import FAMILIES

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs"


def tiny_gemma3():
    family = FAMILIES["gemma3"]
    config = family.config_from_hf(dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4,
                                        sliding_window_pattern=2, query_pre_attn_scalar=8, max_position_embeddings=64))
    torch.manual_seed(0)
    backbone = family.backbone(config).eval()
    return CausalLM(backbone, family.head(backbone), None, config)


def main():
    DOCS.mkdir(exist_ok=True)
    vec = kw.ControlVector.load(HERE / "data" / "happy.gguf")
    lm = kw.load("gemma3-270m", progress=False)
    kw.plot(lm.backbone, DOCS / "gemma3_before.svg")
    kw.plot(lm.steer(vec, 0.5), DOCS / "gemma3_steered.svg")
    tiny = tiny_gemma3()
    width = tiny.head.weight.shape[1]
    kw.plot(tiny.steer(kw.ControlVector({1: torch.ones(width)}), 0.5).cached, DOCS / "cached_steered_tiny.svg")
    for name in ("gemma3_before", "gemma3_steered", "cached_steered_tiny"):
        print(f"wrote {DOCS / name}.svg")


if __name__ == "__main__":
    main()
