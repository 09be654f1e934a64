"""bench/ggml_matmul.py's "repack" column: llama.cpp's own path (a weight in ggml's CPU_REPACK
buffer, computed by ggml's CPU backend) gives ggml's products, so the column times what it says."""
import sys
from pathlib import Path

import pytest
import torch

from kvwire.kernels.build import BuildError
from kvwire.kernels.ggml.lib import GGMLUnavailable, library

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import ggml_matmul  # noqa: E402


@pytest.fixture(scope="module")
def libs():
    try:
        return library(), ggml_matmul.repack_library()
    except (GGMLUnavailable, BuildError) as e:
        pytest.skip(f"ggml kernels or the bench's helper cannot be built here: {e}")


@pytest.mark.parametrize("fmt", sorted(ggml_matmul.REPACKED))
@pytest.mark.parametrize("rows", [1, 5])
def test_the_repacked_product_is_ggmls_product(libs, fmt, rows):
    from kvwire.quant.ggml import GGMLLinear

    lib, repack = libs
    if not repack.kvb_repack_name():
        pytest.skip("ggml has no extra (repack) buffer type on this CPU")
    g = torch.Generator().manual_seed(rows)
    layer = GGMLLinear.quantize(torch.randn(64, 512, generator=g), fmt, kernel="ggml")
    x = torch.randn(rows, 512, generator=g)
    run, close = ggml_matmul.repacked_product(repack, layer, x, 2)
    if run is None:
        pytest.skip(f"ggml does not repack {fmt} on this CPU")
    try:
        got = run().clone()
        got_again = run()
    finally:
        close()
    want = ggml_matmul.product(lib.kvw_graph_matmuls, layer, x, 2)
    # the same 8-bit activations and integer sums in another order: float rounding apart
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    torch.testing.assert_close(got_again, got, rtol=0, atol=0)
    assert float(want.abs().max()) > 1.0  # not two zero outputs


def test_a_weight_ggml_would_not_repack_is_refused_not_run(libs):
    """Q6_K has no repack traits on x86: the helper says so (the column is empty) instead of letting
    ggml dereference the missing traits, which crashed the process."""
    from kvwire.quant.ggml import GGMLLinear

    _, repack = libs
    if not repack.kvb_repack_name():
        pytest.skip("ggml has no extra (repack) buffer type on this CPU")
    layer = GGMLLinear.quantize(torch.randn(64, 512), "q6_k", kernel="ggml")
    run, close = ggml_matmul.repacked_product(repack, layer, torch.randn(1, 512), 2)
    assert run is None
    close()
