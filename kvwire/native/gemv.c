/* One-row float32 products, y = W x (+ b), at memory speed on CPUs with AVX-512.
 *
 * A decode step at batch 1 multiplies every weight by one row: a GEMV whose speed is how fast the
 * weight streams from memory. On the AMX Xeon kvwire is measured on, MKL's `linear` read the default
 * model's 262144 x 640 head in 22.9-23.6 ms; MKL's packed copy of it in 19.4-21.2 ms, but that is a
 * second copy (0.64 GB). This kernel reads the weight in place, row-major as torch holds it, in blocks
 * of 4 rows: each row's next 64 floats go to 4 accumulators (16 independent FMA chains hide the FMA
 * latency, 4 nearby streams keep the prefetchers ahead; 16 rows of one accumulator each, 8 x 2 and
 * 2 x 8 were slower), no horizontal sum until a row's end: 19.3-20.8 ms (session 26, one process,
 * interleaved runs). Blocks go to OpenMP threads in static order: each thread streams one contiguous
 * span, and a row's sum does not depend on the thread count. Compiled with -mavx512f and called only
 * where the CPU has AVX-512F (kvwire/native/gemv.py).
 */
#include <immintrin.h>
#include <stdint.h>

#define ROWS 4    /* rows a block */
#define UNROLL 4  /* 16-float chunks a row a step */

/* the mask of the last, partial 16-float chunk of a row of k floats (all ones when k % 16 == 0) */
static inline __mmask16 tail_mask(int64_t k) {
    int64_t rest = k % 16;
    return rest ? (__mmask16)((1u << rest) - 1u) : (__mmask16)0xFFFF;
}

/* y[0..rows) = W[0..rows) . x for rows <= ROWS: steps of UNROLL chunks, single chunks, a masked tail */
static inline void block(const float *w, int64_t ldw, const float *x, int64_t k, int64_t rows, float *y) {
    __m512 acc[ROWS][UNROLL];
    for (int r = 0; r < ROWS; r++)
        for (int u = 0; u < UNROLL; u++) acc[r][u] = _mm512_setzero_ps();
    int64_t c = 0;
    if (rows == ROWS) {  /* the common case, unrolled by the compiler over constant bounds */
        for (; c + 16 * UNROLL <= k; c += 16 * UNROLL)
            for (int u = 0; u < UNROLL; u++) {
                __m512 xv = _mm512_loadu_ps(x + c + 16 * u);
                for (int r = 0; r < ROWS; r++)
                    acc[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * ldw + c + 16 * u), xv, acc[r][u]);
            }
    }
    for (; c + 16 <= k; c += 16) {
        __m512 xv = _mm512_loadu_ps(x + c);
        for (int r = 0; r < rows; r++) acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * ldw + c), xv, acc[r][0]);
    }
    if (c < k) {
        __mmask16 m = tail_mask(k);
        __m512 xv = _mm512_maskz_loadu_ps(m, x + c);
        for (int r = 0; r < rows; r++)
            acc[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + r * ldw + c), xv, acc[r][0]);
    }
    for (int r = 0; r < rows; r++) {
        __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
        y[r] = _mm512_reduce_add_ps(sum);
    }
}

/* y (n) = W (n x k, rows ldw floats apart) x (k) + bias (n, or NULL), on `threads` threads */
void kvw_gemv_f32(const float *w, int64_t ldw, const float *x, const float *bias, float *y,
                  int64_t n, int64_t k, int threads) {
    int64_t blocks = (n + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t row = b * ROWS, rows = n - row < ROWS ? n - row : ROWS;
        block(w + row * ldw, ldw, x, k, rows, y + row);
        if (bias)
            for (int64_t r = 0; r < rows; r++) y[row + r] += bias[row + r];
    }
}
