/* `kvwire::ggml_matmul`, `kvwire::ggml_matmuls` and `kvwire::ggml_rows` as PyTorch operators with C++
 * CPU kernels (schemas and shape functions are declared in ops.py).
 *
 * A decode step makes ~130 of these calls; through a Python kernel each cost ~20 us of dispatch
 * before any work, ~2.5 ms a token on the default model. Registered here, the dispatcher reaches
 * `kvw_matmuls` (matmul.c, linked into the same library) in ~3 us, eager and compiled alike.
 * `ggml_matmuls` runs several weights that read the same input in one call (fuse.py makes them).
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

extern "C" {
int kvw_supported(int type);
int64_t kvw_block_size(int type);
int64_t kvw_row_bytes(int type, int64_t n);
int kvw_matmuls(int count, const int *types, const void *const *ws, const int64_t *outs, int64_t n,
                const float *x, int64_t rows, float *const *ys, int threads);
int kvw_rows(int type, const void *w, int64_t rows, int64_t n, const int64_t *ids, int64_t count, float *dst);
}

/* `w` must be contiguous (out, row_bytes) uint8 blocks of ggml type `type`, in_features weights a row:
 * the kernels read them unchecked, and ggml aborts the process on a row that is not whole blocks. */
static void check_blocks(const char *op, const at::Tensor &w, int type, int64_t in_features) {
    TORCH_CHECK(kvw_supported(type), op, ": ggml has no CPU dot product for type ", type);
    TORCH_CHECK(in_features > 0 && in_features % kvw_block_size(type) == 0, op, ": type ", type, " packs ",
                kvw_block_size(type), " weights a block; in_features = ", in_features,
                " is not a positive multiple of it");
    const int64_t row_bytes = kvw_row_bytes(type, in_features);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == row_bytes && w.is_contiguous(), op,
                ": expected contiguous (out, ", row_bytes, ") uint8 blocks for ", in_features,
                " weights a row of type ", type, ", got ", w.sizes(), " ", w.scalar_type());
}

/* x (rows, in_features) float32 @ W_i^T for each W_i (out_i, in_features) as ggml blocks
 * (out_i, row_bytes) uint8 of type qtypes[i] -> [(rows, out_i)]. */
static std::vector<at::Tensor> ggml_matmuls(const at::Tensor &x, at::TensorList blocks, at::IntArrayRef qtypes,
                                            int64_t in_features) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
                "ggml_matmul: expected x of shape (rows, ", in_features, ") float32, got ", x.sizes(), " ",
                x.scalar_type());
    TORCH_CHECK(blocks.size() == qtypes.size() && !blocks.empty() && blocks.size() <= 8,
                "ggml_matmuls: expected 1 to 8 weights with a type each, got ", blocks.size(), " weights and ",
                qtypes.size(), " types");
    const at::Tensor xc = x.contiguous();
    std::vector<at::Tensor> ys;
    std::vector<int> types;
    std::vector<const void *> ws;
    std::vector<int64_t> outs;
    std::vector<float *> y_ptrs;
    for (size_t i = 0; i < blocks.size(); i++) {
        const at::Tensor &w = blocks[i];
        const int type = (int)qtypes[i];
        check_blocks("ggml_matmul", w, type, in_features);
        ys.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
        types.push_back(type);
        ws.push_back(w.data_ptr());
        outs.push_back(w.size(0));
        y_ptrs.push_back(ys.back().data_ptr<float>());
    }
    const int rc = x.size(0) == 0 ? 0 : kvw_matmuls((int)types.size(), types.data(), ws.data(), outs.data(),
                                                     in_features, xc.data_ptr<float>(), x.size(0), y_ptrs.data(),
                                                     at::get_num_threads());
    TORCH_CHECK(rc != -1, "ggml_matmul could not allocate memory for ", x.size(0), " quantised activation rows");
    TORCH_CHECK(rc == 0, "ggml_matmul: ggml's compute failed (status ", rc, ") for ", x.size(0), " rows");
    return ys;
}

static at::Tensor ggml_matmul(const at::Tensor &x, const at::Tensor &blocks, int64_t qtype, int64_t in_features) {
    return ggml_matmuls(x, {blocks}, {qtype}, in_features)[0];
}

/* Rows `ids` (any shape, integers) of W (out, in_features) as ggml blocks (out, row_bytes) uint8 ->
 * (*ids.shape, in_features) float32: a token embedding's lookup on a quantised table. */
static at::Tensor ggml_rows(const at::Tensor &ids, const at::Tensor &blocks, int64_t qtype, int64_t in_features) {
    const int type = (int)qtype;
    check_blocks("ggml_rows", blocks, type, in_features);
    TORCH_CHECK(!at::isFloatingType(ids.scalar_type()) && !at::isComplexType(ids.scalar_type()) &&
                    ids.scalar_type() != at::kBool,
                "ggml_rows: expected integer token ids, got ", ids.scalar_type());
    const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
    const int64_t *id = flat.data_ptr<int64_t>();
    for (int64_t i = 0; i < flat.numel(); i++)  // the rows are read unchecked
        TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < blocks.size(0), "token id ", id[i], " is out of range for an ",
                          "embedding table of ", blocks.size(0), " rows (expected 0 <= id < ", blocks.size(0), ")");
    std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
    shape.push_back(in_features);
    at::Tensor out = at::empty(shape, blocks.options().dtype(at::kFloat));
    const int rc = kvw_rows(type, blocks.data_ptr(), blocks.size(0), in_features, id, flat.numel(),
                            out.data_ptr<float>());
    TORCH_CHECK(rc == 0, "ggml_rows could not allocate memory to unpack a group of 16 rows");
    return out;
}

TORCH_LIBRARY_IMPL(kvwire, CPU, m) {
    m.impl("ggml_rows", &ggml_rows);
    m.impl("ggml_matmul", &ggml_matmul);
    m.impl("ggml_matmuls", &ggml_matmuls);
}
