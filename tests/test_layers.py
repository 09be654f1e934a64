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


def test_one_row_pack_matches_linear_and_follows_weight_edits():
    import copy

    from kvwire.layers.linear import OneRowPack

    if not torch.backends.mkl.is_available():
        pytest.skip("no MKL in this torch build")
    pack = OneRowPack(after=3)
    w = torch.randn(300, 48)
    x = torch.randn(1, 1, 48)
    with torch.inference_mode():
        assert pack(x, w) is None and pack(x, w) is None and pack.packed is None  # not packed for short runs
        got = pack(x, w)
        assert got.shape == (1, 1, 300)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w))
        assert pack.packed is not None
        w.mul_(2.0)  # an in-place edit: the packed copy must follow (packed again after 3 calls)
        assert pack(x, w) is None and pack(x, w) is None
        torch.testing.assert_close(pack(x, w), torch.nn.functional.linear(x, w))
        assert pack(torch.randn(2, 48), w) is None  # several rows: `linear` does them
        assert pack(x.bfloat16(), w.bfloat16()) is None
    with torch.enable_grad():  # another test may leave grad mode off in this process
        assert pack(x, w.requires_grad_()) is None  # autograd: the packed kernel has no backward
    assert copy.deepcopy(pack).packed is None
