"""The default model exported to ONNX: onnxruntime's greedy tokens equal eager kvwire's, for one
prompt and for a left-padded batch. Marked `real` and `heavy` (about a minute; runs with
KVWIRE_HEAVY_TESTS=1, see conftest.py)."""
import pytest
import torch

import kvwire as kw

pytestmark = [pytest.mark.real, pytest.mark.heavy]

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


def test_default_model_onnx_greedy_equals_eager(default_lm, tmp_path):
    pytest.importorskip("onnxruntime")
    kw.export(default_lm, tmp_path / "gemma3.onnx", max_length=96)
    runtime = kw.load_exported(tmp_path / "gemma3.onnx")
    with torch.inference_mode():
        assert runtime.generate(PROMPTS[0], max_new_tokens=16) == default_lm.generate(PROMPTS[0], max_new_tokens=16)
        assert runtime.generate(PROMPTS, max_new_tokens=16) == default_lm.generate(PROMPTS, max_new_tokens=16)
