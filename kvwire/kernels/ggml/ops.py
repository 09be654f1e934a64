"""The `kvwire::ggml_*` operators: schemas and shapes here, kernels in op.cpp (loaded by `lib.library()`).

Declared on import, before the bridge registers their CPU kernels; shapes alone let compilers and
exporters trace a model on ggml blocks without the bridge.
"""
import torch

torch.library.define("kvwire::ggml_matmul", "(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor")
torch.library.define("kvwire::ggml_matmuls",
                     "(Tensor x, Tensor[] blocks, int[] qtypes, int in_features) -> Tensor[]")
torch.library.define("kvwire::ggml_rows", "(Tensor ids, Tensor blocks, int qtype, int in_features) -> Tensor")


@torch.library.register_fake("kvwire::ggml_matmul")
def _(x, blocks, qtype, in_features):
    """x (rows, in) float32 @ W^T, W (out, in) as ggml blocks (out, row_bytes) uint8 -> (rows, out)."""
    return x.new_empty(x.shape[0], blocks.shape[0])


@torch.library.register_fake("kvwire::ggml_matmuls")
def _(x, blocks, qtypes, in_features):
    """ggml_matmul for several weights reading the same x (fuse.py) -> [(rows, out_i)]."""
    return [x.new_empty(x.shape[0], b.shape[0]) for b in blocks]


@torch.library.register_fake("kvwire::ggml_rows")
def _(ids, blocks, qtype, in_features):
    """Rows `ids` (...) of W (out, in) as ggml blocks (out, row_bytes) uint8 -> (..., in) float32."""
    return blocks.new_empty(*ids.shape, in_features, dtype=torch.float32)
