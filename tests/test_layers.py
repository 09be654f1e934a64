"""Layer-level checks that the model-level runners would only show indirectly."""
import pytest
import torch

from kvwire.layers.linear import SMALL_ROWS, linear


@pytest.mark.parametrize("rows", [1, 4, SMALL_ROWS, SMALL_ROWS + 1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernel_choice_matches_nn_functional(rows, dtype, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got = linear(x, w, b)
    assert got.shape == (rows, 3, 40) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
