/* kvwire's bridge to ggml's CPU kernels: y = x @ W^T with W in a GGUF block format.
 *
 * ggml (llama.cpp's tensor library) owns the formats and the SIMD dot products; this file only
 * loops over rows. Activations are quantised once per call to the format ggml pairs with the
 * weight's (Q8_0 / Q8_K for most), exactly as llama.cpp does, then every output row is one
 * `vec_dot` against the quantised activation rows. Output rows are split across OpenMP threads
 * (the process's one libgomp: torch's, when torch is loaded first).
 *
 * Built by kvwire/quant/ggml/lib.py with gcc against the ggml shipped by llama-cpp-python.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

void kvw_init(void) { ggml_cpu_init(); }

int64_t kvw_block_size(int type) { return ggml_blck_size((enum ggml_type)type); }

int64_t kvw_row_bytes(int type, int64_t n) { return (int64_t)ggml_row_size((enum ggml_type)type, n); }

/* 1 if the CPU backend has a dot product for this weight type, else 0. */
int kvw_supported(int type) {
    if (type < 0 || type >= GGML_TYPE_COUNT) return 0;
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    if (t->vec_dot == NULL) return 0;
    if (t->vec_dot_type != GGML_TYPE_F32 &&
        ggml_get_type_traits_cpu(t->vec_dot_type)->from_float == NULL) return 0;
    return 1;
}

/* y (rows, out) = x (rows, n) @ W^T, W (out, n) in `type` blocks. Returns 0, or -1 on no memory. */
int kvw_matmul(int type, const void *w, int64_t out, int64_t n, const float *x, int64_t rows,
               float *y, int threads) {
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    const size_t w_row = ggml_row_size((enum ggml_type)type, n);
    const void *xq = x;
    size_t x_row = (size_t)n * sizeof(float);
    void *scratch = NULL;
    if (t->vec_dot_type != GGML_TYPE_F32) {
        x_row = ggml_row_size(t->vec_dot_type, n);
        scratch = malloc(x_row * (size_t)rows);
        if (scratch == NULL) return -1;
        ggml_from_float_t quantize = ggml_get_type_traits_cpu(t->vec_dot_type)->from_float;
        for (int64_t r = 0; r < rows; r++)
            quantize(x + r * n, (char *)scratch + r * x_row, n);
        xq = scratch;
    }
    const ggml_vec_dot_t dot = t->vec_dot;
    /* blocks of output rows: a weight row is read once and dotted with every activation row */
    const int64_t block = 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o0 = 0; o0 < out; o0 += block) {
        const int64_t o1 = o0 + block < out ? o0 + block : out;
        for (int64_t o = o0; o < o1; o++) {
            const char *wrow = (const char *)w + o * w_row;
            for (int64_t r = 0; r < rows; r++)
                dot((int)n, y + r * out + o, 0, wrow, 0, (const char *)xq + r * x_row, 0, 1);
        }
    }
    free(scratch);
    return 0;
}

/* dst (rows, n) float32 = the weight's values, rows split across threads. */
void kvw_dequantize(int type, const void *w, int64_t rows, int64_t n, float *dst, int threads) {
    const ggml_to_float_t to_float = ggml_get_type_traits((enum ggml_type)type)->to_float;
    const size_t w_row = ggml_row_size((enum ggml_type)type, n);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        to_float((const char *)w + r * w_row, dst + r * n, n);
}

/* Quantise src (rows, n) float32 into dst (rows, row_bytes). Returns the bytes written. */
int64_t kvw_quantize(int type, const float *src, void *dst, int64_t rows, int64_t n) {
    return (int64_t)ggml_quantize_chunk((enum ggml_type)type, src, dst, 0, rows, n, NULL);
}
