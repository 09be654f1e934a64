/* llama.cpp's own repacked kernels, for bench/ggml_matmul.py's "repack" column: a weight put in
 * the CPU backend's extra buffer type (ggml repacks Q4_0, Q4_K, Q8_0, IQ4_NL, ... into its
 * interleaved layout there, as llama.cpp does at load on CPUs with AVX2 or better), then y = x @ W^T
 * through ggml's CPU backend, as llama.cpp computes a MUL_MAT on such a weight.
 *
 * Built by the bench with gcc against the ggml shipped by llama-cpp-python; not part of kvwire.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

struct repacked {
    struct ggml_context *wctx, *ctx;
    ggml_backend_buffer_t wbuf;
    ggml_backend_t backend;
    struct ggml_tensor *x, *y;
    struct ggml_cgraph *graph;
};

/* ggml's CPU_REPACK buffer type, or NULL where this build has none (the CPU device lists its extra
 * buffer types: AMX, KleidiAI, repack, ... whichever it was built with). */
static ggml_backend_buffer_type_t repack_type(void) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    typedef ggml_backend_buffer_type_t *(*extra_t)(ggml_backend_dev_t);
    extra_t get = (extra_t)ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu),
                                                              "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t *t = get ? get(cpu) : NULL; t && *t; t++)
        if (strcmp(ggml_backend_buft_name(*t), "CPU_REPACK") == 0) return *t;
    return NULL;
}

/* "CPU_REPACK" where ggml has that buffer type, else NULL. */
const char *kvb_repack_name(void) {
    ggml_backend_buffer_type_t type = repack_type();
    return type ? ggml_backend_buft_name(type) : NULL;
}

void kvb_repack_close(struct repacked *r);

/* W (out, n) of ggml type `type` (ggml's layout) repacked in the CPU_REPACK buffer, and a graph for
 * `rows` activation rows on `threads` threads; NULL where there is no such buffer or ggml does not
 * repack this type and shape on this CPU (it would run its plain kernel: not what the column times). */
struct repacked *kvb_repack_open(int type, const void *w, int64_t n, int64_t out, int rows, int threads) {
    ggml_backend_buffer_type_t buft = repack_type();
    if (buft == NULL) return NULL;
    struct repacked *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    struct ggml_init_params params = {ggml_tensor_overhead() * 8 + ggml_graph_overhead() + 1024, NULL, true};
    r->wctx = ggml_init(params);
    r->ctx = ggml_init(params);
    struct ggml_tensor *wt = ggml_new_tensor_2d(r->wctx, (enum ggml_type)type, n, out);
    r->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(r->wctx, buft);
    if (r->wbuf == NULL || wt->extra == NULL) { /* no repack traits for it: setting it would crash */
        kvb_repack_close(r);
        return NULL;
    }
    ggml_backend_tensor_set(wt, w, 0, ggml_nbytes(wt)); /* ggml repacks here */
    /* activations and outputs point at the caller's memory (kvb_repack_matmul): nothing is copied */
    r->x = ggml_new_tensor_2d(r->ctx, GGML_TYPE_F32, n, rows);
    r->y = ggml_mul_mat(r->ctx, wt, r->x);
    r->graph = ggml_new_graph(r->ctx);
    ggml_build_forward_expand(r->graph, r->y);
    r->backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(r->backend, threads);
    return r;
}

/* y (rows, out) = x (rows, n) @ W^T; returns ggml's status (0: success). */
int kvb_repack_matmul(struct repacked *r, const float *x, float *y) {
    r->x->data = (void *)x;
    r->y->data = y;
    return ggml_backend_graph_compute(r->backend, r->graph);
}

void kvb_repack_close(struct repacked *r) {
    if (r->backend) ggml_backend_free(r->backend);
    if (r->wbuf) ggml_backend_buffer_free(r->wbuf);
    ggml_free(r->wctx);
    ggml_free(r->ctx);
    free(r);
}
