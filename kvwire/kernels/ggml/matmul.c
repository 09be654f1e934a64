/* kvwire's bridge to ggml's CPU kernels: y = x @ W^T with W in a GGUF block format.
 *
 * ggml (llama.cpp's tensor library) owns the formats and the SIMD dot products; this file only
 * loops over rows. Activations are quantised once per call to the format ggml pairs with the
 * weight's (Q8_0 / Q8_K for most), exactly as llama.cpp does, then every output row is one
 * `vec_dot` against the quantised activation rows. Weights that read the same input (a layer's
 * q/k/v) can go in one call. Output rows are split across OpenMP threads
 * (the process's one libgomp: torch's, when torch is loaded first).
 *
 * That loop serves one or two rows (decode); more rows go through ggml's own graph
 * (`kvw_graph_matmuls`), which tiles rows x columns and wins from three rows on for most formats
 * (`kvw_matmuls` chooses; bench/ggml_matmul.py measures).
 *
 * Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weights repacked for x16 (`x16.c`; AVX-512 VNNI, or AVX2 for Q4_1,
 * Q8_0, Q4_K and Q6_K) carry kvwire's own type numbers (KVW_Q4_1_X16 .. KVW_Q6_K_X16) and run that file's
 * kernel in the row loop, at every row count.
 *
 * Built by kvwire/kernels/ggml/lib.py with gcc against the ggml shipped by llama-cpp-python.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

/* bytes ahead of the row being read that ggml's row-by-row dot products ask the cache for (as x16.c) */
#define PREFETCH 4096

/* kvwire's type numbers for blocks in x16.c's layout */
#define KVW_Q4_1_X16 1001
#define KVW_Q5_0_X16 1002
#define KVW_Q8_0_X16 1003
#define KVW_Q4_K_X16 1004
#define KVW_Q6_K_X16 1005

int kvw_x16_supported(int type);
void kvw_x16_repack(int type, const void *src, void *dst, int64_t rows, int64_t n, int to_x16);
int64_t kvw_x16_act_bytes(int type, int64_t n);
void kvw_x16_quantize(int type, const float *x, int64_t n, void *dst);
void kvw_x16_dots(int type, int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                  int64_t y_stride);

void kvw_init(void) { ggml_cpu_init(); }

static int is_x16(int type) {
    return type == KVW_Q4_1_X16 || type == KVW_Q5_0_X16 || type == KVW_Q8_0_X16 || type == KVW_Q4_K_X16 ||
           type == KVW_Q6_K_X16;
}

/* ggml's type a kvwire type number stands for (a repacked type's blocks hold the same bytes) */
static enum ggml_type ggml_type_of(int type) {
    return type == KVW_Q4_1_X16 ? GGML_TYPE_Q4_1 : type == KVW_Q5_0_X16 ? GGML_TYPE_Q5_0 :
           type == KVW_Q8_0_X16 ? GGML_TYPE_Q8_0 : type == KVW_Q4_K_X16 ? GGML_TYPE_Q4_K :
           type == KVW_Q6_K_X16 ? GGML_TYPE_Q6_K : (enum ggml_type)type;
}

int64_t kvw_block_size(int type) { return ggml_blck_size(ggml_type_of(type)); }

int64_t kvw_row_bytes(int type, int64_t n) { return (int64_t)ggml_row_size(ggml_type_of(type), n); }

/* 1 if the CPU backend has a dot product for this weight type, else 0. */
int kvw_supported(int type) {
    if (is_x16(type)) return kvw_x16_supported(ggml_type_of(type));
    if (type < 0 || type >= GGML_TYPE_COUNT) return 0;
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    if (t->vec_dot == NULL) return 0;
    if (t->vec_dot_type != GGML_TYPE_F32 &&
        ggml_get_type_traits_cpu(t->vec_dot_type)->from_float == NULL) return 0;
    return 1;
}

enum { MAX_WEIGHTS = 8 };

/* ys[i] (rows, outs[i]) = x (rows, n) @ W_i^T for `count` (<= 8) weights W_i (outs[i], n) in
 * types[i] blocks, e.g. one layer's q/k/v projections: the activation rows are quantised once per
 * partner format, and all the weights' output rows are split across threads in one parallel loop.
 * Every type must be one kvw_supported takes (the operator checks them; kvw_loop_matmuls for other
 * callers). Returns 0, -1 on no memory. */
static int loop_matmuls(int count, const int *types, const void *const *ws, const int64_t *outs, int64_t n,
                        const float *x, int64_t rows, float *const *ys, int threads) {
    const int64_t block = 16; /* output rows a task (x16's row group): a weight row is read once for every activation row */
    const void *xq[MAX_WEIGHTS];
    void *scratch[MAX_WEIGHTS] = {0};
    size_t x_row[MAX_WEIGHTS], w_row[MAX_WEIGHTS];
    ggml_vec_dot_t dot[MAX_WEIGHTS];
    int64_t first[MAX_WEIGHTS + 1]; /* first task of each weight */
    first[0] = 0;
    for (int i = 0; i < count; i++) {
        const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu(ggml_type_of(types[i]));
        /* the partner format: x16's own (ggml's partner blocks and floats), else ggml's (F32: none) */
        const int partner = is_x16(types[i]) ? types[i] : (int)t->vec_dot_type;
        dot[i] = t->vec_dot;
        w_row[i] = ggml_row_size(ggml_type_of(types[i]), n);
        first[i + 1] = first[i] + (outs[i] + block - 1) / block;
        xq[i] = x;
        x_row[i] = (size_t)n * sizeof(float);
        if (partner == GGML_TYPE_F32) continue;
        x_row[i] = is_x16(partner) ? (size_t)kvw_x16_act_bytes(ggml_type_of(partner), n)
                                   : ggml_row_size(t->vec_dot_type, n);
        int j = 0; /* an earlier weight with the same partner format has the rows quantised already */
        while (j < i && (is_x16(types[j]) ? types[j] :
                         (int)ggml_get_type_traits_cpu(ggml_type_of(types[j]))->vec_dot_type) != partner) j++;
        if (j < i) {
            xq[i] = xq[j];
            continue;
        }
        scratch[i] = malloc(x_row[i] * (size_t)rows);
        if (scratch[i] == NULL) {
            for (int k = 0; k < i; k++) free(scratch[k]);
            return -1;
        }
        /* a prompt's rows split across the threads (ggml's Q8_K quantiser is scalar: 512 rows of 1024
         * took 2.3 ms on one core of a 2-core AMD EPYC); a decode step's few rows stay on this thread */
        #pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
        for (int64_t r = 0; r < rows; r++) {
            char *dst = (char *)scratch[i] + r * x_row[i];
            if (is_x16(partner)) kvw_x16_quantize(ggml_type_of(partner), x + r * n, n, dst);
            else ggml_get_type_traits_cpu(t->vec_dot_type)->from_float(x + r * n, dst, n);
        }
        xq[i] = scratch[i];
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < first[count]; task++) {
        int i = 0;
        while (task >= first[i + 1]) i++;
        const int64_t o0 = (task - first[i]) * block;
        const int64_t o1 = o0 + block < outs[i] ? o0 + block : outs[i];
        if (is_x16(types[i])) { /* a task is one packed group of 16 rows */
            kvw_x16_dots(ggml_type_of(types[i]), n, (const char *)ws[i] + o0 * w_row[i], o1 - o0, xq[i], rows,
                         ys[i] + o0, outs[i]);
            continue;
        }
        for (int64_t o = o0; o < o1; o++) {
            const char *wrow = (const char *)ws[i] + o * w_row[i];
            /* the next rows' bytes on their way while this one is read: the hardware prefetcher alone
             * leaves a decode step's weight stream at a fraction of the memory's speed */
            for (size_t line = 0; line < w_row[i]; line += 64) __builtin_prefetch(wrow + PREFETCH + line, 0, 3);
            for (int64_t r = 0; r < rows; r++)
                dot[i]((int)n, ys[i] + r * outs[i] + o, 0, wrow, 0, (const char *)xq[i] + r * x_row[i], 0, 1);
        }
    }
    for (int i = 0; i < count; i++) free(scratch[i]);
    return 0;
}

/* loop_matmuls for callers that have not checked the types (ctypes: bench, tests). Returns 0, -1 on no
 * memory, -2 for more than 8 weights, -3 for a type this CPU has no kernel for (e.g. a repacked type
 * x16 does not run here: its kernel would misread the blocks). */
int kvw_loop_matmuls(int count, const int *types, const void *const *ws, const int64_t *outs, int64_t n,
                     const float *x, int64_t rows, float *const *ys, int threads) {
    if (count > MAX_WEIGHTS) return -2;
    for (int i = 0; i < count; i++)
        if (!kvw_supported(types[i])) return -3;
    return loop_matmuls(count, types, ws, outs, n, x, rows, ys, threads);
}

/* The same products through ggml's own graph: one MUL_MAT node a weight, computed by ggml's CPU
 * backend as llama.cpp computes them (activation rows quantised to the partner format once a node,
 * work split into row x column tiles across ggml's threads, ggml's tiled GEMM kernels where the build
 * has them). The tensors only point at the caller's memory: nothing is copied. Returns 0, -1 on no
 * memory, -2 for more than 8 weights, -3 if ggml's compute failed. */
int kvw_graph_matmuls(int count, const int *types, const void *const *ws, const int64_t *outs, int64_t n,
                      const float *x, int64_t rows, float *const *ys, int threads) {
    if (count > MAX_WEIGHTS) return -2;
    const size_t nodes = 2 * MAX_WEIGHTS + 2;
    const size_t mem = ggml_tensor_overhead() * nodes + ggml_graph_overhead_custom(nodes, false) + 1024;
    struct ggml_init_params params = {mem, NULL, true};
    struct ggml_context *ctx = ggml_init(params);
    if (ctx == NULL) return -1;
    struct ggml_tensor *xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, rows);
    xt->data = (void *)x;
    struct ggml_cgraph *graph = ggml_new_graph_custom(ctx, nodes, false);
    for (int i = 0; i < count; i++) {
        struct ggml_tensor *w = ggml_new_tensor_2d(ctx, (enum ggml_type)types[i], n, outs[i]);
        w->data = (void *)ws[i];
        struct ggml_tensor *y = ggml_mul_mat(ctx, w, xt);
        y->data = ys[i];
        ggml_build_forward_expand(graph, y);
    }
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, NULL);
    /* the quantised activation rows: a buffer a call, so no thread keeps one after it is gone */
    void *work = plan.work_size ? malloc(plan.work_size) : NULL;
    if (plan.work_size && work == NULL) {
        ggml_free(ctx);
        return -1;
    }
    plan.work_data = work;
    const enum ggml_status status = ggml_graph_compute(graph, &plan);
    free(work);
    ggml_free(ctx);
    return status == GGML_STATUS_SUCCESS ? 0 : -3;
}

/* The row loop or ggml's graph, whichever is faster for these shapes (bench/ggml_matmul.py; numbers in
 * docs/kernels.md, Measurements): the graph from 3 rows, the loop at one or two; a vocabulary-sized
 * head (over 65536 rows) streams fastest through the loop below 8 rows, and so do Q4_1 and Q5_1, which
 * ggml runs row by row too. The types must be ones kvw_supported takes (the operator checks each).
 * Returns as kvw_graph_matmuls. */
int kvw_matmuls(int count, const int *types, const void *const *ws, const int64_t *outs, int64_t n,
                const float *x, int64_t rows, float *const *ys, int threads) {
    if (count > MAX_WEIGHTS) return -2;
    int graph = rows >= 8;
    if (rows >= 3 && rows < 8) {
        graph = 1;
        for (int i = 0; i < count; i++)  /* Q4_1 / Q5_1: no tiled kernel, the graph only adds its cost */
            if (outs[i] > 65536 || types[i] == GGML_TYPE_Q4_1 || types[i] == GGML_TYPE_Q5_1) graph = 0;
    }
    for (int i = 0; i < count; i++)
        if (is_x16(types[i])) graph = 0; /* its own kernel at any row count; ggml's graph does not know the layout */
    return (graph ? kvw_graph_matmuls : loop_matmuls)(count, types, ws, outs, n, x, rows, ys, threads);
}

/* dst (rows, n) float32 = the weight's values, rows split across threads. Repacked rows are
 * unpacked to ggml's layout a group of 16 at a time first (`w` must start a group).
 * Returns 0, or -1 on no memory. */
int kvw_dequantize(int type, const void *w, int64_t rows, int64_t n, float *dst, int threads) {
    const ggml_to_float_t to_float = ggml_get_type_traits(ggml_type_of(type))->to_float;
    const size_t w_row = ggml_row_size(ggml_type_of(type), n);
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:failed)
    for (int64_t g = 0; g < rows; g += 16) {
        const int64_t u = rows - g < 16 ? rows - g : 16;
        const char *src = (const char *)w + g * w_row;
        char *plain = is_x16(type) ? malloc(u * w_row) : NULL;
        if (is_x16(type) && plain == NULL) {
            failed = 1;
            continue;
        }
        if (plain != NULL) kvw_x16_repack(ggml_type_of(type), src, plain, u, n, 0);
        for (int64_t r = 0; r < u; r++) to_float((plain ? plain : src) + r * w_row, dst + (g + r) * n, n);
        free(plain);
    }
    return failed ? -1 : 0;
}

/* dst (count, n) float32 = rows ids[0..count) of w (rows, row bytes) of `type`: a token embedding's
 * lookup on a quantised table, dequantising only the rows asked for. Ids were checked against `rows`
 * by the caller. A repacked row is read by unpacking its 16-row group first. Returns -1 when out of memory. */
int kvw_rows(int type, const void *w, int64_t rows, int64_t n, const int64_t *ids, int64_t count, float *dst) {
    const enum ggml_type t = ggml_type_of(type);
    const ggml_to_float_t to_float = ggml_get_type_traits(t)->to_float;
    const size_t w_row = ggml_row_size(t, n);
    char *plain = is_x16(type) ? malloc(16 * w_row) : NULL;
    if (is_x16(type) && plain == NULL) return -1;
    for (int64_t i = 0; i < count; i++) {
        const int64_t id = ids[i];
        if (plain == NULL) {
            to_float((const char *)w + id * w_row, dst + i * n, n);
            continue;
        }
        const int64_t g = id - id % 16;
        kvw_x16_repack(t, (const char *)w + g * w_row, plain, rows - g < 16 ? rows - g : 16, n, 0);
        to_float(plain + (id - g) * w_row, dst + i * n, n);
    }
    free(plain);
    return 0;
}

/* dst = src's rows of ggml type `type` (Q4_1, Q5_0, Q8_0, Q4_K) in x16.c's layout (`to_x16`) or back, groups
 * of 16 rows split across threads. */
void kvw_x16_repack_rows(int type, const void *src, void *dst, int64_t rows, int64_t n, int to_x16, int threads) {
    const size_t w_row = ggml_row_size((enum ggml_type)type, n);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < rows; g += 16)
        kvw_x16_repack(type, (const char *)src + g * w_row, (char *)dst + g * w_row, rows - g < 16 ? rows - g : 16,
                       n, to_x16);
}

/* Quantise src (rows, n) float32 into dst (rows, row_bytes). Returns the bytes written. */
int64_t kvw_quantize(int type, const float *src, void *dst, int64_t rows, int64_t n) {
    return (int64_t)ggml_quantize_chunk((enum ggml_type)type, src, dst, 0, rows, n, NULL);
}
