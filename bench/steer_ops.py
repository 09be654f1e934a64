"""What steering operations cost in decoding: SmolLM2 plain against the same model with an operation
at every block, in one run.

    python bench/steer_ops.py [--threads 2] [--new 48] [--rounds 3] [--tiny]

Variants: `add` (a vector added after every block), `ablate` (a direction projected out of every
residual write: block 0's input and every attention and MLP write, the refusal-direction recipe),
`clamp` (the projection on a direction clamped after every block), `gated` (a probe at block 4
gating an addition after every later block), `bank8` (the server's inline bank: 8 idle slots
after every block, what a server pays when no request carries a vector), `sae16x` (a random JumpReLU
SAE 16x the width at block 4's output, 8 features set: the layer keeps only those 8 columns). Each decodes `--new` tokens greedily after an
8-token prompt at batch 1 and 8; the best of `--rounds` interleaved rounds is kept. Prints
tokens/s and each variant's rate over plain's, with the CPU. `--tiny` runs a random 4-layer llama.

Each timed call starts without packed weight copies (`WeightPack`, freed by `clear_packs`): the
variants share the plain model's weights, and a copy made during one variant's run (after 64
products of one row count) would serve the next variant's, so the order of the runs, not the
steering, would choose the head's kernel.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import header  # noqa: E402

PRESET = "smollm2-135m-instruct"


def variants(tiny):
    """{name: model}: the plain model and each steered copy (weights shared)."""
    import torch

    import kvwire as kw
    from kvwire.graph import numbered_blocks
    from kvwire.serve.inline import InlineBank
    from kvwire.steer import Steer
    from kvwire.steer.gate import Gate, GatedInsert

    if tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from tests.conftest import FAMILIES

        lm = kw.from_hf(FAMILIES["llama"]())
    else:
        lm = kw.load(PRESET, progress=False)
    width = lm.head.weight.shape[1]
    g = torch.Generator().manual_seed(0)
    v, d, w = (torch.randn(width, generator=g) for _ in range(3))
    blocks = sorted(numbered_blocks(lm.backbone))
    probe_at = blocks[min(4, len(blocks) - 2)]
    later = [i for i in blocks if i > probe_at]
    gated = lm.edit(GatedInsert(f"layers.{probe_at}.block_out", Gate(w, layer=probe_at).probe(),
                                {f"layers.{i}.block_out": Steer(v * 0.1, 1.0, name="gated") for i in later}),
                    depth="layer")
    return {"plain": lm,
            "add": lm.steer(kw.ControlVector({i: v * 0.1 for i in blocks}), 1.0),
            "ablate": lm.ablate(d, layers=[0], site="resid_pre").ablate(d, site="attn_out").ablate(d, site="mlp_out"),
            "clamp": lm.clamp(d, -1.0, 1.0),
            "gated": gated,
            "bank8": InlineBank(lm, slots=8).apply(lm),
            "sae16x": lm.steer_features(random_sae(width, 16 * width, probe_at, g), {i: 2.0 for i in range(8)})}


def random_sae(width, features, layer, g):
    import torch

    from kvwire.steer import SAE

    return SAE(W_enc=torch.randn(width, features, generator=g) / width ** 0.5, b_enc=torch.zeros(features),
               W_dec=torch.randn(features, width, generator=g) / width ** 0.5, b_dec=torch.zeros(width),
               threshold=torch.rand(features, generator=g) * 0.1, hook_name=f"blocks.{layer}.hook_resid_post")


def rate(lm, batch, new):
    import torch

    from kvwire.layers.linear import clear_packs

    ids = torch.randint(3, 90, (batch, 8), generator=torch.Generator().manual_seed(0))
    clear_packs(lm)  # every variant from the same kernels (see the module docstring)
    start = time.perf_counter()
    lm.generate(list(ids), max_new_tokens=new, ignore_eos=True)
    return batch * new / (time.perf_counter() - start)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    models = variants(args.tiny)
    for lm in models.values():  # warm-up: graphs built, first-call allocations
        rate(lm, 1, 2), rate(lm, 8, 2)
    best = {}
    for _ in range(args.rounds):
        for batch in (1, 8):
            for name, lm in models.items():
                key = (batch, name)
                best[key] = max(best.get(key, 0.0), rate(lm, batch, args.new))
    print(header(args.threads))
    print(f"{'variant':<8} {'b1 tok/s':>9} {'/plain':>7} {'b8 tok/s':>9} {'/plain':>7}")
    for name in models:
        print(f"{name:<8} {best[1, name]:>9.1f} {best[1, name] / best[1, 'plain']:>7.3f} "
              f"{best[8, name]:>9.1f} {best[8, name] / best[8, 'plain']:>7.3f}")
    return best


if __name__ == "__main__":
    main()
