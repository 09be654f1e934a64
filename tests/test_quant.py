"""Weight-only int8/int4 quantisation: the kernels compute what the stored weights say, the cached
graph of a quantised model agrees with its uncached forward, and bad requests fail clearly."""
import pytest
import torch

import kvwire as kw
from kvwire.quant import QuantizedLinear

from .conftest import FAMILIES


@pytest.mark.parametrize("scheme, max_rel", [("int8", 0.01), ("int4", 0.12)])
def test_dequantized_weight_is_close(scheme, max_rel):
    # 4 bits over a Gaussian group's min..max range: ~8 % relative error; 8 bits per row: ~0.6 %
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    d = QuantizedLinear(w, None, scheme, 32).dequantize()
    assert ((d - w).norm() / w.norm()).item() < max_rel


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 100])
def test_forward_equals_dequantized_matmul(scheme, rows):
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(16, 64, generator=g), torch.randn(16, generator=g), torch.randn(rows, 64, generator=g)
    q = QuantizedLinear(w, b, scheme, 32)
    expected = x @ q.dequantize().t() + b
    # few rows run the kernel on bfloat16 activations (relative rounding 2^-8 per input)
    tol = 0.05 * expected.abs().max().item() if rows <= 64 else 1e-4
    assert torch.allclose(q(x), expected, atol=tol)
    assert q(x.view(1, rows, 64)).shape == (1, rows, 16)


def test_quantized_model_cached_equals_uncached(family):
    lm = kw.quantize(kw.from_hf(FAMILIES[family]()), "int4")
    ids = torch.tensor([[3, 17, 42, 9, 55, 23, 8]])
    full = lm(ids)[0]
    out = lm.generate(ids, max_new_tokens=4, ignore_eos=True, return_logprobs=True)
    rollout = ids
    for _ in range(4):  # uncached greedy rollout through the same quantised layers
        rollout = torch.cat([rollout, lm(rollout)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tokens[0] == rollout[0, ids.shape[1]:].tolist()
    assert full.shape == (7, lm.vocab_size)


def test_quantize_swaps_every_linear_and_the_head(tiny_lm):
    ids = torch.tensor([[3, 17, 42, 9]])
    before = tiny_lm(ids)
    kw.quantize(tiny_lm, "int8")
    names = [n for n, m in tiny_lm.backbone.named_modules() if isinstance(m, torch.nn.Linear)]
    assert names == [] and tiny_lm.head.quantized is not None
    after = tiny_lm(ids)
    assert ((after - before).norm() / before.norm()).item() < 0.05  # int8: close to float


def test_bad_quantize_requests():
    with pytest.raises(ValueError, match="unknown quantisation scheme 'int3'"):
        QuantizedLinear(torch.randn(8, 64), None, "int3")
    with pytest.raises(ValueError, match="group_size must be 32, 64, 128 or 256 and divide in_features=48; got 32"):
        QuantizedLinear(torch.randn(8, 48), None, "int4", 32)
    with pytest.raises(ValueError, match="unknown quantize='fp8'"):
        kw.load("gemma3-270m", quantize="fp8")
