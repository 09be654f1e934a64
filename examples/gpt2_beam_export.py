"""coremltools #2008's scenario: a distil GPT-2 (6 layers, 12 heads, 768 wide, vocabulary 21128)
with a KV cache and beam size 3, exported as one graph with no control flow.

The report there needed two `if` branches (prefill / decode), padded outputs and disabled passes,
and its Core ML model still failed to load. Here the cached graph is exported as it is and run in
onnxruntime with kvwire's beam search; the tokens equal the eager model's. Random weights (the
original checkpoint is not needed to show the mechanics; nothing is downloaded).

    python examples/gpt2_beam_export.py [OUT.onnx]
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvwire as kw

DISTIL_GPT2_CONFIG = dict(n_layer=6, n_head=12, n_embd=768, vocab_size=21128, n_positions=512, bos_token_id=101,
                   eos_token_id=102)


def distil_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return kw.from_hf(GPT2LMHeadModel(GPT2Config(**DISTIL_GPT2_CONFIG)).eval())


def main(out=None):
    torch.set_grad_enabled(False)
    lm = distil_gpt2()
    prompt = torch.tensor([101, 2769, 4263, 872, 8024])
    beam = kw.BeamSearch(num_beams=3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(out or Path(tmp) / "distil_gpt2.onnx")
        start = time.perf_counter()
        report = kw.export(lm, path, max_length=64, overwrite=True)
        print(f"exported {path.name}: {report['bytes'] / 1e6:.0f} MB in {time.perf_counter() - start:.0f} s")
        onnx_lm = kw.load_exported(path)
        eager = lm.generate(prompt, max_new_tokens=12, sampler=beam).tolist()
        runtime = onnx_lm.generate(prompt, max_new_tokens=12, sampler=beam).tolist()
    print("eager beam(3):      ", eager)
    print("onnxruntime beam(3):", runtime)
    print("equal:", eager == runtime)
    return eager == runtime


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1] if len(sys.argv) > 1 else None) else 1)
