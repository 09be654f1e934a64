/* kvwire's one-pass elementwise kernels on CPUs with AVX-512F, float32 and bfloat16: a gated MLP's
 * act(gate) * up, and RMSNorm. PyTorch's eager ops make a pass (and a temporary) per step, with
 * bfloat16 converted to float32 and back around each.
 *
 * Gated: act is tanh-approximated GELU (Gemma's GeGLU) or SiLU (Llama's SwiGLU); PyTorch's
 * `gelu(approximate="tanh")` alone costs several times the product after it (docs/kernels.md,
 * Measurements). Here both activations are
 * x * sigmoid(z), z = x for SiLU and 2 sqrt(2/pi) (x + 0.044715 x^3) for GELU (0.5 (1 + tanh(y)) =
 * sigmoid(2 y)), with e^-z from Cephes' polynomial of the reduced argument scaled by 2^n (`vscalefps`):
 * a few ulp of float32 from the exact value (GELU: |z| ulp more, z's own rounding). The result is
 * rounded where PyTorch's two ops round: act(gate) to the tensor's dtype, then the product (bfloat16:
 * to nearest even, NaN kept NaN). bfloat16 acts are the exact act's rounding but where the few ulp
 * cross a rounding boundary (0.12 % of GELU's on random values, one step). They differ from PyTorch's
 * below x = -3 for GELU, where PyTorch's 0.5 x (1 + tanh(y)) cancels (at x = -5: -2.98e-7 against the
 * exact -2.29e-7): tiny values, and there the kernel is the accurate one. An act below about 1e-36
 * may come out as 0 (GELU below x = -10, where e^-z overflows float32 first).
 *
 * RMSNorm: y = x / sqrt(mean(x^2) + eps) * w (or * (1 + w), Gemma's), all in float32, rounded once to
 * the output's dtype, as kvwire's RMSNorm computes it; a row's sum of squares in 16 float32 lanes.
 *
 * Work goes to OpenMP threads in fixed chunks of elements or rows: a value never depends on the
 * thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define KVW_GELU_TANH 0
#define KVW_SILU 1
#define CHUNK 4096  /* elements a thread takes at a time (a multiple of 16) */

/* e^t; beyond |t| = 150 (past float32's range either way) t is clamped so that the reduced argument
 * stays exact, and `vscalefps` gives 0 or inf as e^t does. NaN comes out as a number, which the
 * caller's product with x turns back into NaN. */
static inline __m512 exp_ps(__m512 t) {
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-150.0f)), _mm512_set1_ps(150.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = t - n ln2, ln2 split in two so that r is exact to float32 */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    /* e^r on |r| <= ln2 / 2 (Cephes' expf coefficients) */
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* act(x) in float32 */
static inline __m512 act_ps(int kind, __m512 x) {
    __m512 z = x;
    if (kind == KVW_GELU_TANH) {
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        z = _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    }
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), z));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* float32 -> bfloat16 bits in the low halves of 32-bit lanes, rounded to nearest even; NaN -> quiet NaN */
static inline __m512i bf16_bits(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

/* 16 floats from 16 bfloat16 values */
static inline __m512 from_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

static inline void gated16_f32(int kind, const float *g, const float *u, float *out) {
    _mm512_storeu_ps(out, _mm512_mul_ps(act_ps(kind, _mm512_loadu_ps(g)), _mm512_loadu_ps(u)));
}

static inline void gated16_bf16(int kind, const uint16_t *g, const uint16_t *u, uint16_t *out) {
    const __m512 a = round_bf16(act_ps(kind, from_bf16(_mm256_loadu_si256((const __m256i *)g))));
    const __m512 y = _mm512_mul_ps(a, from_bf16(_mm256_loadu_si256((const __m256i *)u)));
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(bf16_bits(y)));
}

/* out[i] = act(g[i]) * u[i], i < n, float32 */
void kvw_gated_f32(int kind, const float *g, const float *u, float *out, int64_t n, int threads) {
    const int64_t whole = n - n % 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < whole; c += CHUNK)
        for (int64_t i = c; i < c + CHUNK && i < whole; i += 16) gated16_f32(kind, g + i, u + i, out + i);
    if (whole < n) {  /* the last n % 16 through a zero-padded copy (AVX-512F has no 16-bit masked moves) */
        float tg[16] = {0}, tu[16] = {0}, to[16];
        for (int64_t i = whole; i < n; i++) tg[i - whole] = g[i], tu[i - whole] = u[i];
        gated16_f32(kind, tg, tu, to);
        for (int64_t i = whole; i < n; i++) out[i] = to[i - whole];
    }
}

/* out[i] = act(g[i]) * u[i], i < n, bfloat16 (computed in float32, rounded after act and after the product) */
void kvw_gated_bf16(int kind, const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n, int threads) {
    const int64_t whole = n - n % 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < whole; c += CHUNK)
        for (int64_t i = c; i < c + CHUNK && i < whole; i += 16) gated16_bf16(kind, g + i, u + i, out + i);
    if (whole < n) {
        uint16_t tg[16] = {0}, tu[16] = {0}, to[16];
        for (int64_t i = whole; i < n; i++) tg[i - whole] = g[i], tu[i - whole] = u[i];
        gated16_bf16(kind, tg, tu, to);
        for (int64_t i = whole; i < n; i++) out[i] = to[i - whole];
    }
}

/* the sum of x[0..n)^2, n a multiple of 16; `bf16`: x holds bfloat16 values */
static inline float sum_squares(const void *x, int64_t n, int bf16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = bf16 ? from_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)))
                              : _mm512_loadu_ps((const float *)x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* out (rows, n) = RMSNorm of x (rows, n) with weight w (n,): x, w and out all float32 (`bf16` 0) or all
 * bfloat16 (1); `offset`: scale by (1 + w). n is a multiple of 16. */
void kvw_rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t n, float eps, int offset,
                  int bf16, int threads) {
    #pragma omp parallel for num_threads(rows >= 8 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float sum = sum_squares((const char *)x + r * n * (bf16 ? 2 : 4), n, bf16);
        const float scale = 1.0f / sqrtf(sum / (float)n + eps);
        const __m512 s = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < n; i += 16) {
            const int64_t at = r * n + i;
            __m512 v, wv;
            if (bf16) {
                v = from_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at)));
                wv = from_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
            } else {
                v = _mm512_loadu_ps((const float *)x + at);
                wv = _mm512_loadu_ps((const float *)w + i);
            }
            const __m512 h = _mm512_mul_ps(v, s);
            const __m512 y = offset ? _mm512_fmadd_ps(h, wv, h) : _mm512_mul_ps(h, wv);
            if (bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(bf16_bits(y)));
            else
                _mm512_storeu_ps((float *)out + at, y);
        }
    }
}
