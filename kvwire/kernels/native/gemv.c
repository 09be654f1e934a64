/* One-row products, y = W x (+ b), at memory speed on CPUs with AVX-512: float32 weights, and bfloat16
 * ones widened to float32 as they are read (x and y are float32 either way).
 *
 * A decode step at batch 1 multiplies every weight by one row: a GEMV whose speed is how fast the
 * weight streams from memory. MKL's `linear` streams it slower, and MKL's packed copy is a second copy
 * of the weight. This kernel reads the weight in place, row-major as torch holds it, in blocks of 4
 * rows: each row's next 64 floats go to 4 accumulators (16 independent FMA chains hide the FMA
 * latency, 4 nearby streams keep the prefetchers ahead; 16 rows of one accumulator each, 8 x 2 and
 * 2 x 8 were slower), no horizontal sum until a row's end (docs/kernels.md, Measurements). Blocks go
 * to OpenMP threads in static order: each thread streams one contiguous span, and a row's sum does
 * not depend on the thread count. Compiled with -mavx512f and called only where the CPU has AVX-512F
 * (kvwire/kernels/native/gemv.py).
 *
 * bfloat16 weights (`kvw_gemv_bf16`): a bfloat16 is a float32's top 16 bits, so 32 of them loaded as
 * 16 32-bit lanes give the even-indexed weights as floats by a shift left of 16 and the odd-indexed by
 * masking the low half off: two cheap integer ops, no shuffles, against x split once a call into its
 * even- and odd-indexed values. Widening each 16 with a zero-extending load instead read a bf16 head
 * no faster than torch's `linear`.
 */
#include <immintrin.h>
#include <stdint.h>

#define ROWS 4    /* rows a block */
#define UNROLL 4  /* 16-float chunks a row a step */
#define PF_ROWS 8  /* bfloat16: rows ahead a block prefetches (4 was slower; 16, 32 the same) */

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

/* y[0..rows) = W[0..rows) . x for bfloat16 rows (`w`, rows ldw elements apart) and x given as its even-
 * and odd-indexed values (xe, xo: k / 2 floats each, k even): a full block in steps of 128 weights a
 * row (4 accumulators a row; the rows PF_ROWS ahead prefetched: a prefetch past the weight's end reads
 * nothing and never faults), then steps of 32, then the rest (fewer than 32) a pair at a time */
static inline void block_bf16(const uint16_t *w, int64_t ldw, const float *xe, const float *xo, int64_t k,
                              int64_t rows, float *y) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();
    int64_t c = 0;
    if (rows == ROWS) {  /* the common case, unrolled by the compiler over constant bounds */
        for (; c + 128 <= k; c += 128)
            for (int u = 0; u < 4; u++) {
                __m512 ev = _mm512_loadu_ps(xe + c / 2 + 16 * u), od = _mm512_loadu_ps(xo + c / 2 + 16 * u);
                for (int r = 0; r < ROWS; r++) {
                    __m512i v = _mm512_loadu_si512((const void *)(w + r * ldw + c + 32 * u));
                    _mm_prefetch((const char *)(w + (r + PF_ROWS) * ldw + c + 32 * u), _MM_HINT_T0);
                    int e = (2 * u) % 4;  /* 4 accumulators a row: 16 FMA chains in all */
                    acc[r][e] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), ev, acc[r][e]);
                    acc[r][e + 1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), od, acc[r][e + 1]);
                }
            }
    }
    for (; c + 32 <= k; c += 32) {
        __m512 ev = _mm512_loadu_ps(xe + c / 2), od = _mm512_loadu_ps(xo + c / 2);
        for (int r = 0; r < rows; r++) {
            __m512i v = _mm512_loadu_si512((const void *)(w + r * ldw + c));
            acc[r][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), ev, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), od, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                                       _mm512_add_ps(acc[r][2], acc[r][3])));
        for (int64_t i = c; i < k; i += 2) {  /* the rest, pairs of weights (k is even) */
            uint32_t lo = (uint32_t)w[r * ldw + i] << 16, hi = (uint32_t)w[r * ldw + i + 1] << 16;
            float a, b;
            __builtin_memcpy(&a, &lo, 4);
            __builtin_memcpy(&b, &hi, 4);
            sum += a * xe[i / 2] + b * xo[i / 2];
        }
        y[r] = sum;
    }
}

/* y (n) = W (n x k bfloat16, rows ldw elements apart) x (k, split by the caller: xe, xo) + bias (n, or
 * NULL), on `threads` threads; k even */
void kvw_gemv_bf16(const uint16_t *w, int64_t ldw, const float *xe, const float *xo, const float *bias, float *y,
                   int64_t n, int64_t k, int threads) {
    int64_t blocks = (n + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t row = b * ROWS, rows = n - row < ROWS ? n - row : ROWS;
        block_bf16(w + row * ldw, ldw, xe, xo, k, rows, y + row);
        if (bias)
            for (int64_t r = 0; r < rows; r++) y[row + r] += bias[row + r];
    }
}
