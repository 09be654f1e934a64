/* `kvwire::ggml_matmul` as a PyTorch operator with a C++ CPU kernel (the schema and the shape
 * function are declared in linear.py).
 *
 * A decode step makes ~130 of these calls; through a Python kernel each cost ~20 us of dispatch
 * before any work, ~2.5 ms a token on the default model. Registered here, the dispatcher reaches
 * `kvw_matmul` (matmul.c, linked into the same library) in ~3 us, eager and compiled alike.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
int kvw_supported(int type);
int64_t kvw_row_bytes(int type, int64_t n);
int kvw_matmul(int type, const void *w, int64_t out, int64_t n, const float *x, int64_t rows, float *y,
               int threads);
}

/* x (rows, in_features) float32 @ W^T, W (out, in_features) as ggml blocks (out, row_bytes) uint8. */
static at::Tensor ggml_matmul(const at::Tensor &x, const at::Tensor &blocks, int64_t qtype, int64_t in_features) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
                "ggml_matmul: expected x of shape (rows, ", in_features, ") float32, got ", x.sizes(), " ",
                x.scalar_type());
    TORCH_CHECK(kvw_supported((int)qtype), "ggml_matmul: ggml has no CPU dot product for type ", qtype);
    const int64_t row_bytes = kvw_row_bytes((int)qtype, in_features);  // blocks are read unchecked: check the size
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == row_bytes &&
                    blocks.is_contiguous(),
                "ggml_matmul: expected contiguous (out, ", row_bytes, ") uint8 blocks for ", in_features,
                " weights a row of type ", qtype, ", got ", blocks.sizes(), " ", blocks.scalar_type());
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({x.size(0), blocks.size(0)}, x.options());
    if (x.size(0) > 0 && kvw_matmul((int)qtype, blocks.data_ptr(), blocks.size(0), in_features,
                                    xc.data_ptr<float>(), x.size(0), y.data_ptr<float>(), at::get_num_threads()))
        TORCH_CHECK(false, "ggml_matmul could not allocate ", x.size(0), " quantised activation rows");
    return y;
}

TORCH_LIBRARY_IMPL(kvwire, CPU, m) { m.impl("ggml_matmul", &ggml_matmul); }
