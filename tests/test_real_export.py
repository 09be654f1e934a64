"""The default model exported to ONNX: onnxruntime's greedy tokens equal eager kvwire's, for one
prompt and for a left-padded batch. Marked `real` (the export takes about two minutes here)."""
import pytest
import torch

import kvwire as kw

pytestmark = pytest.mark.real
pytest.importorskip("onnxruntime")


def test_default_model_onnx_greedy_equals_eager(tmp_path):
    lm = kw.load("gemma3-270m", progress=False)
    kw.export(lm, tmp_path / "gemma3.onnx", max_length=96)
    runtime = kw.load_exported(tmp_path / "gemma3.onnx")
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
    with torch.inference_mode():
        assert runtime.generate(prompts[0], max_new_tokens=16) == lm.generate(prompts[0], max_new_tokens=16)
        assert runtime.generate(prompts, max_new_tokens=16) == lm.generate(prompts, max_new_tokens=16)
