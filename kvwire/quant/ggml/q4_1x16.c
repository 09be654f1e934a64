/* Q4_1 weights laid out for AVX-512 VNNI: sixteen weight rows a step instead of one block.
 *
 * ggml's Q4_1 dot product handles one block of 32 weights at a time (~20 instructions: nibble
 * unpacking, a dot product, half-precision scale lookups, a horizontal sum a row) and is bound by
 * that arithmetic, not by memory (bench/decode_bound.py). Here the same blocks are repacked,
 * losslessly and in the same number of bytes, so that one 64-byte load holds 4 bytes of the same
 * block of 16 rows: every int32 lane of a VNNI dot product belongs to one output row, 8 `vpdpbusd`
 * finish a block for 16 rows against the activation's bytes broadcast, the 16 rows' scales and
 * minimums are one half-precision load each, and no horizontal sum is left at the end. The
 * activations are ggml's own Q8_1 blocks (as ggml's Q4_1 dot product pairs them), so each block's
 * integer dot product and its scaling are ggml's; only the order of the float sums differs.
 *
 * Rows go in groups of 16 (the last may hold fewer, u), a group in the bytes its rows held:
 * for each block b of 32 weights,
 *   qs: 4 chunks of u x 4 bytes; chunk k, lane j = bytes 4k..4k+3 of row j's block b nibbles
 *       (low nibbles: weights 4k..4k+3 of the block; high nibbles: weights 16+4k..16+4k+3)
 *   d:  u half-precision scales; m: u half-precision minimums            = 20 u bytes, as Q4_1.
 * So rows 16G.. of the packed weight sit where they sat in ggml's layout: slicing at multiples of
 * 16 rows still works.
 *
 * Built by lib.py into kvwire's ggml bridge; the kernel runs only where `kvw_x16_supported()`.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

enum { QK = 32, GROUP = 16, Q4_1_BYTES = 20, Q8_1_BYTES = 36 };

typedef struct { ggml_fp16_t d, m; uint8_t qs[16]; } q4_1_block;
typedef struct { ggml_fp16_t d, s; int8_t qs[32]; } q8_1_block;

int kvw_x16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* Q4_1 rows (rows, n / 32 blocks) <-> the layout above; `to_x16` chooses the direction. */
void kvw_x16_repack(const void *src, void *dst, int64_t rows, int64_t n, int to_x16) {
    const int64_t blocks = n / QK, row_bytes = blocks * Q4_1_BYTES;
    for (int64_t g = 0; g < rows; g += GROUP) {
        const int64_t u = rows - g < GROUP ? rows - g : GROUP;
        uint8_t *packed = (uint8_t *)(to_x16 ? dst : src) + g * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *chunk = packed + b * u * Q4_1_BYTES;
            ggml_fp16_t *d = (ggml_fp16_t *)(chunk + 16 * u), *m = d + u;
            for (int64_t j = 0; j < u; j++) {
                q4_1_block *plain = (q4_1_block *)((uint8_t *)(to_x16 ? src : dst) + (g + j) * row_bytes) + b;
                for (int k = 0; k < 4; k++) {
                    uint8_t *lane = chunk + k * 4 * u + 4 * j;
                    if (to_x16) memcpy(lane, plain->qs + 4 * k, 4);
                    else memcpy(plain->qs + 4 * k, lane, 4);
                }
                if (to_x16) { d[j] = plain->d; m[j] = plain->m; }
                else { plain->d = d[j]; plain->m = m[j]; }
            }
        }
    }
}

/* Bytes of one activation row for kvw_x16_dots: its Q8_1 blocks, then each block's scale and sum
 * as floats. */
int64_t kvw_x16_act_bytes(int64_t n) { return n / QK * (Q8_1_BYTES + 2 * (int64_t)sizeof(float)); }

/* One activation row x (n floats) -> dst (kvw_x16_act_bytes(n)): ggml's Q8_1 quantisation. */
void kvw_x16_quantize(const float *x, int64_t n, void *dst) {
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_1)->from_float(x, dst, n);
    const q8_1_block *q = (const q8_1_block *)dst;
    float *scale = (float *)((uint8_t *)dst + n / QK * Q8_1_BYTES), *sum = scale + n / QK;
    for (int64_t b = 0; b < n / QK; b++) {
        scale[b] = ggml_fp16_to_fp32(q[b].d);
        sum[b] = ggml_fp16_to_fp32(q[b].s);
    }
}

/* y[r * y_stride + j] = row j (< u <= 16) of the packed row group `w` . activation row r, for
 * r < rows (rows made by kvw_x16_quantize, kvw_x16_act_bytes(n) apart). Activation rows go four at
 * a time against one read of the group's nibbles. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void kvw_x16_dots(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y, int64_t y_stride) {
    enum { R = 4 };
    const int64_t blocks = n / QK, act_bytes = kvw_x16_act_bytes(n);
    const __mmask16 lanes = (__mmask16)((1u << u) - 1);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        const int nr = rows - r0 < R ? (int)(rows - r0) : R;
        const uint8_t *a[R];
        const float *scale[R], *sum[R];
        __m512 acc[R], mins[R];
        for (int r = 0; r < R; r++) {
            a[r] = (const uint8_t *)x + (r0 + (r < nr ? r : 0)) * act_bytes;
            scale[r] = (const float *)(a[r] + blocks * Q8_1_BYTES);
            sum[r] = scale[r] + blocks;
            acc[r] = mins[r] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *chunk = (const uint8_t *)w + b * u * Q4_1_BYTES;
            __m512i q[8];
            for (int k = 0; k < 4; k++) {
                const __m512i bytes = _mm512_maskz_loadu_epi32(lanes, chunk + k * 4 * u);
                q[k] = _mm512_and_si512(bytes, low);
                q[4 + k] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, chunk + 16 * u));
            const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, chunk + 18 * u));
            for (int r = 0; r < nr; r++) {
                const int32_t *qx = (const int32_t *)(a[r] + b * Q8_1_BYTES + 4);  /* past d and s */
                __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
                for (int k = 0; k < 8; k += 2) {
                    even = _mm512_dpbusd_epi32(even, q[k], _mm512_set1_epi32(qx[k]));
                    odd = _mm512_dpbusd_epi32(odd, q[k + 1], _mm512_set1_epi32(qx[k + 1]));
                }
                const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
                acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(scale[r][b])), acc[r]);
                mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r][b]), mins[r]);
            }
        }
        for (int r = 0; r < nr; r++)
            _mm512_mask_storeu_ps(y + (r0 + r) * y_stride, lanes, _mm512_add_ps(acc[r], mins[r]));
    }
}
