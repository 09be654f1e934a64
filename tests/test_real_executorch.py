"""The default model exported to ExecuTorch: the runtime's greedy tokens equal eager kvwire's for a
left-padded batch. Marked `real` and `heavy` (export about a minute and a half from cold caches; runs
with KVWIRE_HEAVY_TESTS=1, see conftest.py)."""
import pytest
import torch

import kvwire as kw

pytestmark = [pytest.mark.real, pytest.mark.heavy]


def test_default_model_executorch_greedy_equals_eager(default_lm, tmp_path):
    """Portable kernels (XNNPACK lowering of this model takes minutes more; bench/export.py
    measures it; portable kernels take ~6 s a call here): entry points for 16 tokens and 1, a
    static batch of 2, one left-padded batch whose longer prompt is one 16-token chunk."""
    pytest.importorskip("executorch")
    path = tmp_path / "gemma3.pte"
    kw.export(default_lm, path, max_length=32, batch_size=2, delegate="portable", prefill_length=16)
    runtime = kw.load_exported(path)
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
    assert [len(default_lm.tokenizer.encode(p)) for p in prompts] == [6, 16]
    with torch.inference_mode():
        assert runtime.generate(prompts, max_new_tokens=4) == default_lm.generate(prompts, max_new_tokens=4)
