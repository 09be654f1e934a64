/* ggml blocks laid out for wide integer dot products (AVX-512 VNNI; AVX2 for Q4_1, Q8_0, Q4_K, Q6_K): sixteen weight rows
 * a step instead of one block.
 *
 * ggml's Q4_1, Q5_0 and Q8_0 dot products handle one block of 32 weights of one row at a time
 * (bit unpacking, a dot product, half-precision scale lookups, a horizontal sum a row) and are bound
 * by that arithmetic, not by memory (bench/decode_bound.py). Here the same blocks are repacked,
 * losslessly and in the same number of bytes, so that one 64-byte load holds 4 bytes of the same
 * block of 16 rows: every int32 lane of a VNNI dot product belongs to one output row, 8 `vpdpbusd`
 * finish a block for 16 rows against the activation's bytes broadcast, the 16 rows' scales are one
 * half-precision load, and no horizontal sum is left at the end. The activations are ggml's own
 * partner blocks (Q8_1 for Q4_1, Q8_0 for Q5_0 and Q8_0), so each block's integer dot product and
 * its scaling are ggml's; only the order of the float sums differs. Q4_K's 256-weight super-blocks
 * (Q8_K partner) go the same way, 8 sub-blocks of 32 a super-block, each sub-block's integer sum
 * times its 6-bit scale, the minimums' term one `vpdpwssd` per two sub-blocks.
 *
 * Rows go in groups of 16 (the last may hold fewer, u), a group in the bytes its rows held:
 * for each block b of 32 weights,
 *   Q4_1, Q5_0: qs: 4 chunks of u x 4 bytes; chunk k, lane j = bytes 4k..4k+3 of row j's block b
 *       nibbles (low nibbles: weights 4k..4k+3 of the block; high nibbles: weights 16+4k..16+4k+3)
 *     Q4_1: d, then m: u half-precision scales and minimums           = 20 u bytes, as Q4_1;
 *     Q5_0: qh: u 32-bit words of fifth bits, byte k = the bits of chunk k's weights 4k..4k+3 (low
 *           half) and 16+4k..16+4k+3 (high half); then d: u scales    = 22 u bytes, as Q5_0.
 *   Q8_0: qs: 8 chunks of u x 4 bytes; chunk k, lane j = weights 4k..4k+3 of row j's block b,
 *       each + 128 (its sign bit flipped: VNNI multiplies unsigned by signed bytes, so the weights
 *       go unsigned and the activation's 128 x its sum comes off the integer sum); then d: u
 *       scales                                                          = 34 u bytes, as Q8_0.
 *   Q4_K (super-blocks of 256 weights, 8 sub-blocks of 32 with 6-bit scales and minimums):
 *     qs: 32 chunks of u x 4 bytes; chunk c, lane j = bytes 4c..4c+3 of row j's 128 nibble bytes
 *       (chunk 8p + k: low nibbles weights 4k..4k+3 of sub-block 2p, high nibbles the same of 2p+1);
 *     scales: 3 chunks of u x 4 bytes, lane j = bytes 4s..4s+3 of row j's 12 packed scale bytes;
 *     then d and dmin: u half-precision values each                    = 144 u bytes, as Q4_K.
 *   Q6_K (super-blocks of 256 weights, 16 groups of 16 with 8-bit scales): its 208 bytes of ql, qh
 *     and scales as 52 chunks of u x 4 bytes, chunk c, lane j = bytes 4c..4c+3 of row j's block
 *     (ql: chunks 0-31, qh: 32-47, scales: 48-51); then d: u half-precision values
 *                                                                       = 210 u bytes, as Q6_K.
 * So rows 16G.. of a packed weight sit where they sat in ggml's layout: slicing at multiples of
 * 16 rows still works.
 *
 * CPUs with AVX2 but no AVX-512 VNNI run Q4_1, Q8_0, Q4_K and Q6_K from the same layout on 8-lane kernels
 * (`dots_rows_q4_1_avx2`, `dots_rows_q8_0_avx2`, `dots_half_q4_k_avx2`, `dots_half_q6_k_avx2`); Q5_0 stays on ggml's
 * kernels there. Q6_K has no VNNI kernel: CPUs with VNNI keep ggml's for it.
 *
 * Built by lib.py into kvwire's ggml bridge; a type runs here only where `kvw_x16_supported(type)`.
 */
#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

enum { QK = 32, QK_K = 256, GROUP = 16 };
/* bytes ahead of the block being read that each block asks the cache for: without it a decode step's
 * weights streamed at ~20 GB/s on a 2-core AMD EPYC whose memory gives a sum 74 GB/s, with it at ~50
 * (bench/decode_bound.py; 1024, 2048 and 8192 bytes were slower). A prefetch past the weight's end
 * reads nothing and never faults; the next row group is the next task of the same thread. */
#define PREFETCH 4096

typedef struct { ggml_fp16_t d, m; uint8_t qs[16]; } q4_1_block;
typedef struct { ggml_fp16_t d; uint8_t qh[4]; uint8_t qs[16]; } q5_0_block;
typedef struct { ggml_fp16_t d, s; int8_t qs[32]; } q8_1_block;
typedef struct { ggml_fp16_t d; int8_t qs[32]; } q8_0_block;
typedef struct { ggml_fp16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } q4_k_block;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_fp16_t d; } q6_k_block;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } q8_k_block;

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define X86 1
#else
#define X86 0
#endif

/* set by kvw_x16_as_avx2: a CPU with AVX-512 VNNI runs x16 as one with AVX2 alone would */
static int as_avx2 = 0;

/* whether the CPU has AVX-512 F, BW, VL and VNNI (what the hardware can run, whatever as_avx2 says) */
static int has_avx512_vnni(void) {
#if !X86
    return 0;
#else
    static int found = -1; /* asked once: every 16-row task of a call asks */
    if (found < 0) {
        __builtin_cpu_init();
        found = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return found;
#endif
}

/* whether x16 takes its AVX-512 VNNI kernels: the hardware has them and as_avx2 is off */
static int avx512_vnni(void) { return has_avx512_vnni() && !as_avx2; }

static int avx2(void) {
#if !X86
    return 0;
#else
    static int found = -1; /* asked once: the operator asks for every weight of every call */
    if (found < 0) {
        __builtin_cpu_init();
        found = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return found;
#endif
}

/* 1 where this CPU runs the x16 kernel for ggml's `type` (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K): the first four
 * with AVX-512 VNNI; Q4_1, Q8_0, Q4_K and Q6_K with AVX2 and no AVX-512 VNNI (Q6_K has an AVX2 kernel alone,
 * measured against ggml's on an AVX2 CPU only: CPUs with VNNI keep ggml's); -1 (any type): whether it
 * runs for at least one. */
int kvw_x16_supported(int type) {
    if (type == GGML_TYPE_Q6_K) return avx2() && !avx512_vnni();
    if (avx512_vnni()) return 1;
    return avx2() && (type == -1 || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q4_1);
}

/* on = 1: from now on run x16 as a CPU with AVX2 but no AVX-512 VNNI would (Q8_0, Q4_K, Q6_K, on the AVX2
 * kernels), so machines with AVX-512 test that path too; 0: as this CPU can; -1: ask. Returns the setting
 * before. Not for use while a product runs: a call's tasks would mix kernels. */
int kvw_x16_as_avx2(int on) {
    const int before = as_avx2;
    if (on >= 0) as_avx2 = on != 0;
    return before;
}

static int is_q4_1(int type) { return type == GGML_TYPE_Q4_1; }
static int is_q5_0(int type) { return type == GGML_TYPE_Q5_0; }
static int is_q8_0(int type) { return type == GGML_TYPE_Q8_0; }
static int is_q4_k(int type) { return type == GGML_TYPE_Q4_K; }
static int is_q6_k(int type) { return type == GGML_TYPE_Q6_K; }
static int is_k(int type) { return is_q4_k(type) || is_q6_k(type); }

static size_t block_bytes(int type) {
    return is_q4_k(type) ? sizeof(q4_k_block) : is_q6_k(type) ? sizeof(q6_k_block) : is_q8_0(type) ? sizeof(q8_0_block) :
           is_q5_0(type) ? sizeof(q5_0_block) : sizeof(q4_1_block);
}

/* weights a block: K-quants' super-blocks hold 256 */
static int64_t block_weights(int type) { return is_k(type) ? QK_K : QK; }

/* qh's bits for weights 4k..4k+3 in byte k's low half, 16+4k..16+4k+3 in its high half (and back) */
static uint32_t reorder_qh(uint32_t qh, int to_x16) {
    uint32_t out = 0;
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 4; i++) {
            const int low = 4 * k + i, high = 16 + 4 * k + i, at_low = 8 * k + i, at_high = 8 * k + 4 + i;
            if (to_x16) out |= ((qh >> low) & 1u) << at_low | ((qh >> high) & 1u) << at_high;
            else out |= ((qh >> at_low) & 1u) << low | ((qh >> at_high) & 1u) << high;
        }
    return out;
}

/* Q8_0 rows' block b of row j <-> its place in a group (u rows at `chunk`): quants with their sign
 * bit flipped (the same map both ways), then the scale */
static void repack_q8_0(uint8_t *plain, uint8_t *chunk, int64_t u, int64_t j, int to_x16) {
    q8_0_block *p = (q8_0_block *)plain;
    uint8_t *qs = (uint8_t *)p->qs;
    for (int k = 0; k < 8; k++) {
        uint8_t *lane = chunk + k * 4 * u + 4 * j;
        uint32_t word;
        memcpy(&word, to_x16 ? qs + 4 * k : lane, 4);
        word ^= 0x80808080u;
        memcpy(to_x16 ? lane : qs + 4 * k, &word, 4);
    }
    ggml_fp16_t *d = (ggml_fp16_t *)(chunk + 32 * u) + j;
    if (to_x16) *d = p->d;
    else p->d = *d;
}

/* Q4_K rows' block b of row j <-> its place in a group (u rows at `chunk`): the nibble bytes and the
 * scale bytes as 4-byte lanes, then d and dmin */
static void repack_q4_k(uint8_t *plain, uint8_t *chunk, int64_t u, int64_t j, int to_x16) {
    q4_k_block *p = (q4_k_block *)plain;
    for (int c = 0; c < 32; c++) {
        uint8_t *lane = chunk + c * 4 * u + 4 * j;
        memcpy(to_x16 ? lane : p->qs + 4 * c, to_x16 ? p->qs + 4 * c : lane, 4);
    }
    for (int c = 0; c < 3; c++) {
        uint8_t *lane = chunk + 128 * u + c * 4 * u + 4 * j;
        memcpy(to_x16 ? lane : p->scales + 4 * c, to_x16 ? p->scales + 4 * c : lane, 4);
    }
    ggml_fp16_t *d = (ggml_fp16_t *)(chunk + 140 * u) + j, *dmin = d + u;
    if (to_x16) { *d = p->d; *dmin = p->dmin; }
    else { p->d = *d; p->dmin = *dmin; }
}

/* Q6_K rows' block b of row j <-> its place in a group (u rows at `chunk`): the low-bit, high-bit and
 * scale bytes as 4-byte lanes, then d */
static void repack_q6_k(uint8_t *plain, uint8_t *chunk, int64_t u, int64_t j, int to_x16) {
    q6_k_block *p = (q6_k_block *)plain;
    for (int c = 0; c < 52; c++) { /* ql, qh, scales: 208 bytes in a row, as 52 lanes */
        uint8_t *lane = chunk + c * 4 * u + 4 * j, *bytes = (uint8_t *)p + 4 * c;
        memcpy(to_x16 ? lane : bytes, to_x16 ? bytes : lane, 4);
    }
    ggml_fp16_t *d = (ggml_fp16_t *)(chunk + 208 * u) + j;
    if (to_x16) *d = p->d;
    else p->d = *d;
}

/* Q4_1, Q5_0, Q8_0, Q4_K or Q6_K rows (`type`: ggml's number; rows, n / 32 or n / 256 blocks) <-> the
 * layout above; `to_x16` chooses the direction. */
void kvw_x16_repack(int type, const void *src, void *dst, int64_t rows, int64_t n, int to_x16) {
    const int64_t blocks = n / block_weights(type), bytes = (int64_t)block_bytes(type), row_bytes = blocks * bytes;
    for (int64_t g = 0; g < rows; g += GROUP) {
        const int64_t u = rows - g < GROUP ? rows - g : GROUP;
        uint8_t *packed = (uint8_t *)(to_x16 ? dst : src) + g * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *chunk = packed + b * u * bytes, *tail = chunk + 16 * u;
            for (int64_t j = 0; j < u; j++) {
                uint8_t *plain = (uint8_t *)(to_x16 ? src : dst) + (g + j) * row_bytes + b * bytes;
                if (is_q8_0(type) || is_k(type)) {
                    (is_q8_0(type) ? repack_q8_0 : is_q4_k(type) ? repack_q4_k : repack_q6_k)(plain, chunk, u, j, to_x16);
                    continue;
                }
                uint8_t *qs = plain + bytes - 16; /* both formats end with their 16 nibble bytes */
                for (int k = 0; k < 4; k++) {
                    uint8_t *lane = chunk + k * 4 * u + 4 * j;
                    memcpy(to_x16 ? lane : qs + 4 * k, to_x16 ? qs + 4 * k : lane, 4);
                }
                if (is_q5_0(type)) {
                    q5_0_block *p = (q5_0_block *)plain;
                    uint32_t *qh = (uint32_t *)tail + j, word;
                    ggml_fp16_t *d = (ggml_fp16_t *)(tail + 4 * u) + j;
                    if (to_x16) { memcpy(&word, p->qh, 4); word = reorder_qh(word, 1); memcpy(qh, &word, 4); *d = p->d; }
                    else { memcpy(&word, qh, 4); word = reorder_qh(word, 0); memcpy(p->qh, &word, 4); p->d = *d; }
                } else {
                    q4_1_block *p = (q4_1_block *)plain;
                    ggml_fp16_t *d = (ggml_fp16_t *)tail + j, *m = d + u;
                    if (to_x16) { *d = p->d; *m = p->m; }
                    else { p->d = *d; p->m = *m; }
                }
            }
        }
    }
}

/* ggml's partner format of the weights, whose blocks lead an activation row */
static int partner(int type) {
    return is_k(type) ? GGML_TYPE_Q8_K : is_q5_0(type) || is_q8_0(type) ? GGML_TYPE_Q8_0 : GGML_TYPE_Q8_1;
}

/* Bytes of one activation row for kvw_x16_dots: its partner blocks, then each block's scale and
 * offset term as floats (Q4_1: scale x sum of quants, times the weight's minimum; Q5_0: -16 x scale
 * x sum of quants, times the weight's scale: Q5_0 stores weights + 16; Q8_0: 128 x sum of quants,
 * exact in a float, taken off the integer sum: the repacked weights are + 128). */
/* where the floats start: after the partner blocks, rounded up to a float's alignment */
static int64_t floats_at(int type, int64_t blocks) {
    return (blocks * (int64_t)ggml_type_size((enum ggml_type)partner(type)) + 3) / 4 * 4;
}

/* (Q4_K's partner blocks, Q8_K, carry their float scale and their quant sums: no floats follow) */
int64_t kvw_x16_act_bytes(int type, int64_t n) {
    if (is_k(type)) return n / QK_K * (int64_t)sizeof(q8_k_block);
    return floats_at(type, n / QK) + n / QK * 2 * (int64_t)sizeof(float);
}

/* One activation row x (n floats) -> dst (kvw_x16_act_bytes): ggml's quantisation to the partner format. */
void kvw_x16_quantize(int type, const float *x, int64_t n, void *dst) {
    ggml_get_type_traits_cpu((enum ggml_type)partner(type))->from_float(x, dst, n);
    if (is_q6_k(type)) return; /* Q6_K reads the 16 sums of 16 quants ggml's Q8_K blocks carry */
    if (is_q4_k(type)) { /* bsums[0..7] become the 8 sub-blocks' quant sums (each within an int16) */
        for (int64_t b = 0; b < n / QK_K; b++) {
            q8_k_block *q = (q8_k_block *)dst + b;
            for (int s = 0; s < 8; s++) q->bsums[s] = (int16_t)(q->bsums[2 * s] + q->bsums[2 * s + 1]);
        }
        return;
    }
    const int64_t blocks = n / QK;
    float *scale = (float *)((uint8_t *)dst + floats_at(type, blocks));
    float *offset = scale + blocks;
    for (int64_t b = 0; b < blocks; b++) {
        if (is_q5_0(type) || is_q8_0(type)) {
            const q8_0_block *q = (const q8_0_block *)dst + b;
            int sum = 0;
            for (int i = 0; i < QK; i++) sum += q->qs[i];
            scale[b] = ggml_fp16_to_fp32(q->d);
            offset[b] = is_q8_0(type) ? 128.0f * (float)sum : -16.0f * scale[b] * (float)sum;
        } else {
            const q8_1_block *q = (const q8_1_block *)dst + b;
            scale[b] = ggml_fp16_to_fp32(q->d);
            offset[b] = ggml_fp16_to_fp32(q->s);
        }
    }
}

#if X86
enum { Q4_1, Q5_0, Q8_0, Q4_K }; /* the kernel's KIND, and ggml's type of each */
static const int KIND_TYPE[] = {GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K};

/* y[r * y_stride + j] = row j (< u <= 16) of the packed row group `w` . activation row r, for the
 * NR (1 to 4, a constant once inlined) rows at a[0..NR-1] (made by kvw_x16_quantize), all against one
 * read of the group's blocks. KIND is a constant too: with both known the loops below unroll and
 * the 8 weight vectors, 4 accumulators and 4 offsets stay in registers. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void dots_rows(const int KIND, const int NR, int64_t n, const void *w, int64_t u,
                             const uint8_t *const *a, float *y, int64_t y_stride) {
    const int FIVE = KIND == Q5_0, EIGHT = KIND == Q8_0;
    const int64_t blocks = n / QK;
    const int64_t bytes = EIGHT ? 34 : FIVE ? 22 : 20, x_block = KIND == Q4_1 ? 36 : 34, x_qs = KIND == Q4_1 ? 4 : 2;
    const int64_t qs_bytes = EIGHT ? 32 : 16; /* a row's quant bytes a block, ahead of the scales */
    const __mmask16 lanes = (__mmask16)((1u << u) - 1);
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    /* a 32-bit lane's four bytes all take byte k of the lane's qh word: shuffle control for k = 0 */
    const __m512i spread = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000);
    const __m512i bit_low = _mm512_set1_epi32(0x08040201), bit_high = _mm512_set1_epi32((int)0x80402010u);
    const float *scale[4], *offset[4];
    __m512 acc[4], offs[4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        scale[r] = (const float *)(a[r] + floats_at(KIND_TYPE[KIND], blocks));
        offset[r] = scale[r] + blocks;
        acc[r] = offs[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = (const uint8_t *)w + b * u * bytes, *tail = chunk + qs_bytes * u;
        for (int64_t line = 0; line < u * bytes; line += 64) __builtin_prefetch(chunk + PREFETCH + line, 0, 3);
        __m512i q[8];
        if (EIGHT) { /* whole bytes: one load a chunk */
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) q[k] = _mm512_maskz_loadu_epi32(lanes, chunk + k * 4 * u);
        } else {
            const __m512i qh = FIVE ? _mm512_maskz_loadu_epi32(lanes, tail) : _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i packed = _mm512_maskz_loadu_epi32(lanes, chunk + k * 4 * u);
                q[k] = _mm512_and_si512(packed, low);
                q[4 + k] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                if (FIVE) { /* the fifth bit: +16 where qh has it */
                    const __m512i bits = _mm512_shuffle_epi8(qh, _mm512_add_epi8(spread, _mm512_set1_epi8((char)k)));
                    q[k] = _mm512_mask_add_epi8(q[k], _mm512_test_epi8_mask(bits, bit_low), q[k], fifth);
                    q[4 + k] = _mm512_mask_add_epi8(q[4 + k], _mm512_test_epi8_mask(bits, bit_high), q[4 + k], fifth);
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, FIVE ? tail + 4 * u : tail));
        const __m512 m = KIND == Q4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, tail + 2 * u)) : d;
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const uint8_t *qx = a[r] + b * x_block + x_qs;
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2) {
                int32_t x0, x1;
                memcpy(&x0, qx + 4 * k, 4);
                memcpy(&x1, qx + 4 * k + 4, 4);
                even = _mm512_dpbusd_epi32(even, q[k], _mm512_set1_epi32(x0));
                odd = _mm512_dpbusd_epi32(odd, q[k + 1], _mm512_set1_epi32(x1));
            }
            __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
            if (EIGHT) /* weights + 128: 128 x the activation's sum comes off (exact: both below 2^24) */
                sums = _mm512_sub_ps(sums, _mm512_set1_ps(offset[r][b]));
            acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(scale[r][b])), acc[r]);
            if (!EIGHT) offs[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(offset[r][b]), offs[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        _mm512_mask_storeu_ps(y + r * y_stride, lanes, EIGHT ? acc[r] : _mm512_add_ps(acc[r], offs[r]));
}

/* Q4_K: y[r * y_stride + j] = row j (< u <= 16) of the packed row group `w` . activation row r (Q8_K
 * blocks), for NR (1 to 4, a constant once inlined) rows against one read of the group's blocks. As
 * ggml's: a super-block's integer sum is sum_s scale_s x (q_s . x_s), its minimums' sum_s min_s x
 * (the sum of x_s's quants), both exact in int32; then d x d_x and dmin x d_x scale them. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void dots_rows_q4_k(const int NR, int64_t n, const void *w, int64_t u, const uint8_t *const *a,
                                  float *y, int64_t y_stride) {
    const int64_t blocks = n / QK_K, bytes = sizeof(q4_k_block);
    const __mmask16 lanes = (__mmask16)((1u << u) - 1);
    const __m512i low = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15),
                  two = _mm512_set1_epi32(3);
    __m512 acc[4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = (const uint8_t *)w + b * u * bytes, *sc = chunk + 128 * u;
        for (int64_t line = 0; line < u * bytes; line += 64) __builtin_prefetch(chunk + PREFETCH + line, 0, 3);
        const __m512i s0 = _mm512_maskz_loadu_epi32(lanes, sc), s1 = _mm512_maskz_loadu_epi32(lanes, sc + 4 * u),
                      s2 = _mm512_maskz_loadu_epi32(lanes, sc + 8 * u);
        const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, chunk + 140 * u));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, chunk + 142 * u));
        const q8_k_block *x[4];
        __m512i isum[4], msum[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            x[r] = (const q8_k_block *)a[r] + b;
            isum[r] = msum[r] = _mm512_setzero_si512();
        }
        /* minimums (ggml's get_scale_min_k4): sub-blocks 0-3 in bytes 4-7, 4-7 in bytes 8-11's high
         * nibbles with their top bits in bytes 4-7's; sub-blocks 2i and 2i + 1 as one lane's int16 pair,
         * against the activation's sub-block sums (kvw_x16_quantize's bsums[2i], [2i + 1]) */
        __m512i m[8];
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const int t = s & 3;
            m[s] = s < 4 ? _mm512_and_si512(_mm512_srli_epi32(s1, 8 * t), six)
                : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 8 * t + 4), four),
                                  _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, 8 * t + 6), two), 4));
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i pair = _mm512_or_si512(m[2 * i], _mm512_slli_epi32(m[2 * i + 1], 16));
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                int32_t sums;
                memcpy(&sums, x[r]->bsums + 2 * i, 4);
                msum[r] = _mm512_dpwssd_epi32(msum[r], pair, _mm512_set1_epi32(sums));
            }
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            __m512i lo[8], hi[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i raw = _mm512_maskz_loadu_epi32(lanes, chunk + (8 * p + k) * 4 * u);
                lo[k] = _mm512_and_si512(raw, low);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            /* scales of sub-blocks 2p and 2p + 1: bytes 0-3, or bytes 8-11's low nibbles with their
             * top bits in bytes 0-3's */
            __m512i scale[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int s = 2 * p + h, t = s & 3;
                scale[h] = s < 4 ? _mm512_and_si512(_mm512_srli_epi32(s0, 8 * t), six)
                    : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 8 * t), four),
                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, 8 * t + 6), two), 4));
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const int8_t *qx = x[r]->qs + 64 * p;
                __m512i dot_lo = _mm512_setzero_si512(), dot_hi = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    int32_t x0, x1;
                    memcpy(&x0, qx + 4 * k, 4);
                    memcpy(&x1, qx + 32 + 4 * k, 4);
                    dot_lo = _mm512_dpbusd_epi32(dot_lo, lo[k], _mm512_set1_epi32(x0));
                    dot_hi = _mm512_dpbusd_epi32(dot_hi, hi[k], _mm512_set1_epi32(x1));
                }
                isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(dot_lo, scale[0]),
                                                                     _mm512_mullo_epi32(dot_hi, scale[1])));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m512 dx = _mm512_set1_ps(x[r]->d);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[r]), _mm512_mul_ps(dmin, dx), acc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) _mm512_mask_storeu_ps(y + r * y_stride, lanes, acc[r]);
}

/* One of the row kernels above, KIND and NR constants once inlined. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void rows_of_kind(const int KIND, const int NR, int64_t n, const void *w, int64_t u,
                                const uint8_t *const *a, float *y, int64_t y_stride) {
    if (KIND == Q4_K) dots_rows_q4_k(NR, n, w, u, a, y, y_stride);
    else dots_rows(KIND, NR, n, w, u, a, y, y_stride);
}

/* Activation rows (`act_bytes` apart at x) four at a time, the last 1 to 4 by their own constant-count
 * copy of the row kernel: CALL(NR) runs it for NR rows at a[0..NR-1] into `out`. A macro, not a
 * function, as the kernels' target attributes differ (AVX-512 VNNI, AVX2). */
#define FOUR_AT_A_TIME(act_bytes, x, rows, y, y_stride, CALL)                                           \
    for (int64_t r0 = 0; r0 < (rows); r0 += 4) {                                                        \
        const uint8_t *a[4];                                                                            \
        for (int r = 0; r < 4; r++) a[r] = (const uint8_t *)(x) + (r0 + r) * (act_bytes); /* past rows: unread */ \
        float *out = (y) + r0 * (y_stride);                                                             \
        switch ((rows) - r0 < 4 ? (rows) - r0 : 4) {                                                    \
        case 1: CALL(1); break;                                                                         \
        case 2: CALL(2); break;                                                                         \
        case 3: CALL(3); break;                                                                         \
        default: CALL(4); break;                                                                        \
        }                                                                                               \
    }

/* All activation rows against one packed row group. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void dots(const int KIND, int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                        int64_t y_stride) {
    const int64_t act_bytes = kvw_x16_act_bytes(KIND_TYPE[KIND], n);
#define ROWS_OF_KIND(NR) rows_of_kind(KIND, NR, n, w, u, a, out, y_stride)
    FOUR_AT_A_TIME(act_bytes, x, rows, y, y_stride, ROWS_OF_KIND)
#undef ROWS_OF_KIND
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void dots_q4_1(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y, int64_t y_stride) {
    dots(Q4_1, n, w, u, x, rows, y, y_stride);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void dots_q5_0(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y, int64_t y_stride) {
    dots(Q5_0, n, w, u, x, rows, y, y_stride);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void dots_q8_0(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y, int64_t y_stride) {
    dots(Q8_0, n, w, u, x, rows, y, y_stride);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void dots_q4_k(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y, int64_t y_stride) {
    dots(Q4_K, n, w, u, x, rows, y, y_stride);
}

/* What the AVX2 kernels share: a 16-row group as two 8-lane halves. */

/* lanes of half h that hold one of the group's u rows */
__attribute__((target("avx2"), always_inline))
static inline __m256i half_mask(int64_t u, int h) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(u - 8 * h)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the 8 half-precision values of half h in the u at p (one per row: d, dmin), as floats; a short
 * group's (FULL 0) padded with zeros, read no further than its u */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 half_values(const int FULL, const uint8_t *p, int64_t u, int h) {
    if (FULL) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
    uint16_t pad[8] = {0};
    memcpy(pad, p + 16 * h, 2 * (size_t)(u - 8 * h < 8 ? u - 8 * h : 8));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pad));
}

/* Q8_0 on AVX2 (with FMA and F16C), for CPUs without AVX-512 VNNI: the same layout, a 16-row group
 * as two 8-lane halves. AVX2 has no unsigned-by-signed byte dot with 32-bit sums; `vpmaddubsw` makes
 * 16-bit pair sums that would saturate on the stored weights + 128, so each chunk goes back to signed
 * bytes and ggml's sign trick applies: |w| (unsigned, at most 128) times the activation byte with w's
 * sign (at most 127 in size; ggml's Q8_0 activations lie in -127..127), whose pair sums stay within
 * int16, then `vpmaddwd` by ones to 32-bit lanes. So each block's integer dot product is ggml's, as
 * above, and no 128 x sum term is needed. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dots_rows_q8_0_avx2(const int NR, int64_t n, const void *w, int64_t u, const uint8_t *const *a,
                                       float *y, int64_t y_stride) {
    const int64_t blocks = n / QK, bytes = sizeof(q8_0_block);
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const __m256i mask[2] = {half_mask(u, 0), half_mask(u, 1)};
    const float *scale[4];
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        scale[r] = (const float *)(a[r] + floats_at(GGML_TYPE_Q8_0, blocks));
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = (const uint8_t *)w + b * u * bytes;
        for (int64_t line = 0; line < u * bytes; line += 64) __builtin_prefetch(chunk + PREFETCH + line, 0, 3);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            if (8 * h >= u) break;
            const __m256 d = half_values(u == GROUP, chunk + 32 * u, u, h);
            __m256i isum[4];
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i q = _mm256_xor_si256(
                    _mm256_maskload_epi32((const int *)(chunk + k * 4 * u + 32 * h), mask[h]), flip);
                const __m256i magnitude = _mm256_abs_epi8(q);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    int32_t x;
                    memcpy(&x, a[r] + b * 34 + 2 + 4 * k, 4);
                    const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(x), q);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(scale[r][b])),
                                            acc[r][h]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2 && 8 * h < u; h++)
            _mm256_maskstore_ps(y + r * y_stride + 8 * h, mask[h], acc[r][h]);
}

__attribute__((target("avx2,fma,f16c")))
static void dots_q8_0_avx2(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                           int64_t y_stride) {
    const int64_t act_bytes = kvw_x16_act_bytes(GGML_TYPE_Q8_0, n);
#define ROWS_AVX2(NR) dots_rows_q8_0_avx2(NR, n, w, u, a, out, y_stride)
    FOUR_AT_A_TIME(act_bytes, x, rows, y, y_stride, ROWS_AVX2)
#undef ROWS_AVX2
}


/* Q4_1 on AVX2 (with FMA and F16C): the same layout, a 16-row group as two 8-lane halves. The
 * nibbles (0..15) go unsigned and ggml's Q8_1 activation bytes (-127..127) signed into `vpmaddubsw`:
 * a pair sum is at most 2 x 15 x 127 = 3810 in size, so a block's eight chunk products add in int16
 * (at most 30480) before one `vpmaddwd` widens them. Each block's integer dot product is ggml's; its
 * minimum's term is m x the activation's scaled sum, as the VNNI kernel's. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dots_rows_q4_1_avx2(const int NR, int64_t n, const void *w, int64_t u, const uint8_t *const *a,
                                       float *y, int64_t y_stride) {
    const int64_t blocks = n / QK, bytes = sizeof(q4_1_block), x_block = sizeof(q8_1_block);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i mask[2] = {half_mask(u, 0), half_mask(u, 1)};
    const float *scale[4], *offset[4];
    __m256 acc[4][2], offs[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        scale[r] = (const float *)(a[r] + floats_at(GGML_TYPE_Q4_1, blocks));
        offset[r] = scale[r] + blocks;
        acc[r][0] = acc[r][1] = offs[r][0] = offs[r][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = (const uint8_t *)w + b * u * bytes, *tail = chunk + 16 * u;
        for (int64_t line = 0; line < u * bytes; line += 64) __builtin_prefetch(chunk + PREFETCH + line, 0, 3);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            if (8 * h >= u) break;
            const __m256 d = half_values(u == GROUP, tail, u, h), m = half_values(u == GROUP, tail + 2 * u, u, h);
            __m256i pairs[4];
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) pairs[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m256i packed = _mm256_maskload_epi32((const int *)(chunk + k * 4 * u + 32 * h), mask[h]);
                const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    int32_t x0, x1; /* weights 4k..4k+3 (low nibbles) and 16+4k..16+4k+3 (high) */
                    memcpy(&x0, a[r] + b * x_block + 4 + 4 * k, 4);
                    memcpy(&x1, a[r] + b * x_block + 4 + 16 + 4 * k, 4);
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r], ones));
                acc[r][h] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_set1_ps(scale[r][b])), acc[r][h]);
                offs[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(offset[r][b]), offs[r][h]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2 && 8 * h < u; h++)
            _mm256_maskstore_ps(y + r * y_stride + 8 * h, mask[h], _mm256_add_ps(acc[r][h], offs[r][h]));
}

__attribute__((target("avx2,fma,f16c")))
static void dots_q4_1_avx2(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                           int64_t y_stride) {
    const int64_t act_bytes = kvw_x16_act_bytes(GGML_TYPE_Q4_1, n);
#define ROWS_AVX2(NR) dots_rows_q4_1_avx2(NR, n, w, u, a, out, y_stride)
    FOUR_AT_A_TIME(act_bytes, x, rows, y, y_stride, ROWS_AVX2)
#undef ROWS_AVX2
}

/* What the AVX2 kernels that run a group a half of its rows at a time (Q4_K, Q6_K) share. */

/* The first half's pass streams a block of the group from memory, the second reads it from cache: that
 * one asks for the same block of the next group (the thread's next task), so memory is busy in both.
 * `block` bytes at `chunk`, `group` bytes a group. */
static inline void prefetch_half(const uint8_t *chunk, int64_t block, int64_t group, int h) {
    const uint8_t *ahead = h == 0 ? chunk + PREFETCH : chunk + group;
    for (int64_t line = 0; line < block; line += 64) __builtin_prefetch(ahead + line, 0, 3);
}

/* y[r * y_stride + 8h + j] = acc[r][j] for NR rows, j over half h's rows */
__attribute__((target("avx2"), always_inline))
static inline void store_half(const int NR, const int FULL, const __m256 *acc, float *y, int64_t y_stride, int h,
                              __m256i mask) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        if (FULL) _mm256_storeu_ps(y + r * y_stride + 8 * h, acc[r]);
        else _mm256_maskstore_ps(y + r * y_stride + 8 * h, mask, acc[r]);
    }
}

/* Q4_K's 6-bit value s (0..7) of each lane's row, as ggml's get_scale_min_k4 reads it from the row's 12
 * scale bytes (lo: bytes 0-3 for scales, 4-7 for minimums; hi: bytes 8-11): s < 4 is lo's byte s, low 6
 * bits; else hi's byte s - 4 (its low nibble for scales, high for minimums: `nibble` 0 or 4) with lo's
 * byte s - 4's top two bits above it. */
__attribute__((target("avx2"), always_inline))
static inline __m256i six_bits(__m256i lo, __m256i hi, const int s, const int nibble) {
    const int t = 8 * (s & 3);
    if (s < 4) return _mm256_and_si256(_mm256_srli_epi32(lo, t), _mm256_set1_epi32(63));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(hi, t + nibble), _mm256_set1_epi32(15)),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(lo, t + 6), _mm256_set1_epi32(3)), 4));
}

/* 32 bytes of half h's lanes at p (the kernels' FULL and mask in scope): a short group's masked */
#define LOAD(p) (FULL ? _mm256_loadu_si256((const __m256i *)(p)) : _mm256_maskload_epi32((const int *)(p), mask))

/* Q4_K on AVX2 (with FMA and F16C): the same layout, a 16-row group as two 8-lane halves. The nibbles
 * are unsigned (0..15), so `vpmaddubsw` against the activation's bytes (|x| <= 128: ggml's Q8_K) makes
 * 16-bit pair sums of at most 2 x 15 x 128; a sub-block's eight chunks add up in 16 bits (at most
 * 30720) before one `vpmaddwd` by the sub-block's 6-bit scale widens them, as ggml's AVX2 kernel does.
 * The minimums' term is one `vpmaddwd` per two sub-blocks against the activation's sub-block sums.
 * Each super-block's integer sums are ggml's; only the order of the float sums differs.
 * y[r * y_stride + 8h + j] for NR (1 to 4, a constant once inlined) activation rows and the rows of
 * H halves from half h (H 1, or 2 from half 0 with NR 1 on a full group): one half at a time, the second
 * reading the group's blocks again from cache (16 rows of 4096 weights are 36 KB), keeps twice fewer
 * accumulators live than both halves at once would, except for one activation row.
 * FULL (u == 16): plain loads; else masked ones, for a last, shorter group. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dots_half_q4_k_avx2(const int NR, const int FULL, const int H, int64_t n, const void *w, int64_t u,
                                       int h, const uint8_t *const *a, float *y, int64_t y_stride) {
    const int64_t blocks = n / QK_K, bytes = sizeof(q4_k_block);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i mask = half_mask(u, h);
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int q = 0; q < H; q++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[q][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = (const uint8_t *)w + b * u * bytes, *sc = chunk + 128 * u;
        prefetch_half(chunk, u * bytes, blocks * u * bytes, H == 2 ? 0 : h);
        const q8_k_block *x[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) x[r] = (const q8_k_block *)a[r] + b;
        __m256i s0[2], s1[2], s2[2];
#pragma GCC unroll 2
        for (int q = 0; q < H; q++) {
            const int at = 32 * (h + q);
            s0[q] = LOAD(sc + at), s1[q] = LOAD(sc + 4 * u + at), s2[q] = LOAD(sc + 8 * u + at);
        }
        /* minimums (ggml's get_scale_min_k4), sub-blocks 2i and 2i + 1 as one lane's int16 pair, against
         * the activation's sub-block sums (kvw_x16_quantize's bsums[2i], [2i + 1]) */
        __m256i msum[2][4];
#pragma GCC unroll 2
        for (int q = 0; q < H; q++)
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) msum[q][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m256i sums[4];
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                int32_t pair_sums;
                memcpy(&pair_sums, x[r]->bsums + 2 * i, 4);
                sums[r] = _mm256_set1_epi32(pair_sums);
            }
#pragma GCC unroll 2
            for (int q = 0; q < H; q++) {
                const __m256i pair = _mm256_or_si256(six_bits(s1[q], s2[q], 2 * i, 4),
                                                     _mm256_slli_epi32(six_bits(s1[q], s2[q], 2 * i + 1, 4), 16));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) msum[q][r] = _mm256_add_epi32(msum[q][r], _mm256_madd_epi16(pair, sums[r]));
            }
        }
        __m256i isum[2][4];
#pragma GCC unroll 2
        for (int q = 0; q < H; q++)
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) isum[q][r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m256i dot_lo[2][4], dot_hi[2][4];
#pragma GCC unroll 2
            for (int q = 0; q < H; q++)
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) dot_lo[q][r] = dot_hi[q][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m256i x0[4], x1[4];
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    int32_t v0, v1;
                    memcpy(&v0, x[r]->qs + 64 * p + 4 * k, 4);
                    memcpy(&v1, x[r]->qs + 64 * p + 32 + 4 * k, 4);
                    x0[r] = _mm256_set1_epi32(v0), x1[r] = _mm256_set1_epi32(v1);
                }
#pragma GCC unroll 2
                for (int q = 0; q < H; q++) {
                    const __m256i raw = LOAD(chunk + (8 * p + k) * 4 * u + 32 * (h + q));
                    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) {
                        dot_lo[q][r] = _mm256_add_epi16(dot_lo[q][r], _mm256_maddubs_epi16(lo, x0[r]));
                        dot_hi[q][r] = _mm256_add_epi16(dot_hi[q][r], _mm256_maddubs_epi16(hi, x1[r]));
                    }
                }
            }
            /* the two sub-blocks' scales (bytes 0-3, or bytes 8-11's low nibbles with their top bits in
             * bytes 0-3's), each as an int16 pair (v, v) */
#pragma GCC unroll 2
            for (int q = 0; q < H; q++) {
                __m256i scale[2];
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) {
                    const __m256i v = six_bits(s0[q], s2[q], 2 * p + e, 0);
                    scale[e] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
                }
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++)
                    isum[q][r] = _mm256_add_epi32(isum[q][r], _mm256_add_epi32(_mm256_madd_epi16(dot_lo[q][r], scale[0]),
                                                                               _mm256_madd_epi16(dot_hi[q][r], scale[1])));
            }
        }
#pragma GCC unroll 2
        for (int q = 0; q < H; q++) {
            const __m256 d = half_values(FULL, chunk + 140 * u, u, h + q), dmin = half_values(FULL, chunk + 142 * u, u, h + q);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const __m256 dx = _mm256_set1_ps(x[r]->d);
                acc[q][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[q][r]), _mm256_mul_ps(d, dx), acc[q][r]);
                acc[q][r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[q][r]), _mm256_mul_ps(dmin, dx), acc[q][r]);
            }
        }
    }
#pragma GCC unroll 2
    for (int q = 0; q < H; q++) store_half(NR, FULL, acc[q], y, y_stride, h + q, mask);
}

/* Q6_K on AVX2 (with FMA and F16C): the same layout, a 16-row group as two 8-lane halves. A weight is
 * ql's nibble and two bits of qh (0..63, ggml's value + 32): `vpmaddubsw` against the activation's bytes
 * (|x| <= 128) makes 16-bit pair sums of at most 2 x 63 x 128, two chunks of a 16-weight group add up
 * in 16 bits (at most 32256) before one `vpmaddwd` by the group's 8-bit scale widens them. The + 32
 * comes off as 32 x sum_g scale_g x (the activation's group sum, ggml's Q8_K bsums), as ggml's AVX2
 * kernel takes it off; a super-block's integer sums (within 2^29) are ggml's, only the order of the
 * float sums differs. NR (1 to 4) activation rows and one half of the group's rows at a time, as the
 * Q4_K kernel. In a super-block's part P (its weights 128P..128P + 127) ql's bytes 64P + l hold the
 * part's weights l (low nibbles) and l + 64 (high), bytes 64P + 32 + l weights l + 32 and l + 96, and
 * qh's byte 32P + l their top bits (bits 0-1, 2-3, 4-5, 6-7 in that order), for l < 32; weight i's
 * scale is group i / 16's. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dots_half_q6_k_avx2(const int NR, const int FULL, int64_t n, const void *w, int64_t u, int h,
                                       const uint8_t *const *a, float *y, int64_t y_stride) {
    const int64_t blocks = n / QK_K, bytes = sizeof(q6_k_block), at = 32 * h;
    const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), word = _mm256_set1_epi32(0xFFFF);
    const __m256i mask = half_mask(u, h);
    __m256 acc[4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *chunk = (const uint8_t *)w + b * u * bytes, *ql = chunk, *qh = chunk + 128 * u,
                      *sc = chunk + 192 * u;
        prefetch_half(chunk, u * bytes, blocks * u * bytes, h);
        const q8_k_block *x[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) x[r] = (const q8_k_block *)a[r] + b;
        /* the 16 groups' scales, each as an int16 pair (v, v) a lane; and sum_g scale_g x bsums[g] */
        __m256i pairs[16], isum[4], msum[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = msum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256i s = LOAD(sc + k * 4 * u + at);
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(s, 24 - 8 * t), 24);
                pairs[4 * k + t] = _mm256_or_si256(_mm256_and_si256(v, word), _mm256_slli_epi32(v, 16));
            }
            const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), odd = _mm256_srai_epi16(s, 8);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const int16_t *bs = x[r]->bsums + 4 * k;
                const int32_t be = (int32_t)((uint16_t)bs[0] | (uint32_t)(uint16_t)bs[2] << 16),
                              bo = (int32_t)((uint16_t)bs[1] | (uint32_t)(uint16_t)bs[3] << 16);
                msum[r] = _mm256_add_epi32(msum[r], _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_set1_epi32(be)),
                                                                     _mm256_madd_epi16(odd, _mm256_set1_epi32(bo))));
            }
        }
        for (int part = 0; part < 2; part++) {
            for (int e2 = 0; e2 < 4; e2++) { /* chunks e = 2 e2, 2 e2 + 1: weights 4e..4e+3 of each quarter */
                const uint8_t *A = ql + (16 * part + 2 * e2) * 4 * u + at, *B = A + 8 * 4 * u,
                              *H = qh + (8 * part + 2 * e2) * 4 * u + at;
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) { /* weights 32m + 4e.. of the part: group 8 part + 2m + e / 4 */
                    const uint8_t *nibbles = m & 1 ? B : A;
                    __m256i q[2];
#pragma GCC unroll 2
                    for (int t = 0; t < 2; t++) { /* the nibble (low for m < 2), then qh's bits 2m, 2m + 1 as bits 4, 5 */
                        const __m256i raw = LOAD(nibbles + t * 4 * u), bits = LOAD(H + t * 4 * u);
                        /* 16-bit shifts: what crosses into a byte from its neighbour lands outside bits 4, 5 */
                        const __m256i top = _mm256_and_si256(m < 2 ? _mm256_slli_epi16(bits, 4 - 2 * m) :
                                                             m == 2 ? bits : _mm256_srli_epi16(bits, 2), bits45);
                        q[t] = _mm256_or_si256(_mm256_and_si256(m < 2 ? raw : _mm256_srli_epi16(raw, 4), low), top);
                    }
                    const __m256i scale = pairs[8 * part + 2 * m + e2 / 2];
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) {
                        const int8_t *qx = x[r]->qs + 128 * part + 32 * m + 8 * e2;
                        int32_t x0, x1;
                        memcpy(&x0, qx, 4);
                        memcpy(&x1, qx + 4, 4);
                        const __m256i dot = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], _mm256_set1_epi32(x0)),
                                                             _mm256_maddubs_epi16(q[1], _mm256_set1_epi32(x1)));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(dot, scale));
                    }
                }
            }
        }
        const __m256 d = half_values(FULL, chunk + 208 * u, u, h);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m256i sum = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(msum[r], 5)); /* - 32 x the minimums */
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x[r]->d)), acc[r]);
        }
    }
    store_half(NR, FULL, acc, y, y_stride, h, mask);
}

#undef LOAD

/* All activation rows against one group of Q4_K or Q6_K (`type`) rows, a half of its rows at a time;
 * one activation row against a full Q4_K group in one pass over both halves (its two accumulators a
 * half fit in registers there): the group's blocks are read once, and the activation's bytes are
 * broadcast once for both halves (1.03-1.13x the two passes' speed at one row, streamed, on a 2-core
 * AVX2-only AMD EPYC). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void dots_k_avx2(const int type, int64_t n, const void *w, int64_t u, const void *x, int64_t rows,
                               float *y, int64_t y_stride) {
    const int64_t act_bytes = kvw_x16_act_bytes(type, n);
#define HALF(NR, FULL) (type == GGML_TYPE_Q4_K ? dots_half_q4_k_avx2(NR, FULL, 1, n, w, u, h, a, out, y_stride) \
                                               : dots_half_q6_k_avx2(NR, FULL, n, w, u, h, a, out, y_stride))
#define HALVES(NR)                                                                                      \
    if (type == GGML_TYPE_Q4_K && NR == 1 && u == GROUP)                                                \
        dots_half_q4_k_avx2(1, 1, 2, n, w, u, 0, a, out, y_stride);                                     \
    else                                                                                                \
        for (int h = 0; h < 2 && 8 * h < u; h++) {                                                      \
            if (u == GROUP) HALF(NR, 1);                                                                \
            else HALF(NR, 0);                                                                           \
        }
    FOUR_AT_A_TIME(act_bytes, x, rows, y, y_stride, HALVES)
#undef HALVES
#undef HALF
}

__attribute__((target("avx2,fma,f16c")))
static void dots_q4_k_avx2(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                           int64_t y_stride) {
    dots_k_avx2(GGML_TYPE_Q4_K, n, w, u, x, rows, y, y_stride);
}

__attribute__((target("avx2,fma,f16c")))
static void dots_q6_k_avx2(int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                           int64_t y_stride) {
    dots_k_avx2(GGML_TYPE_Q6_K, n, w, u, x, rows, y, y_stride);
}

#endif

/* y[r * y_stride + j] = row j of `type`'s (Q4_1, Q5_0, Q8_0, Q4_K or Q6_K) packed row group `w` . activation row r. */
void kvw_x16_dots(int type, int64_t n, const void *w, int64_t u, const void *x, int64_t rows, float *y,
                  int64_t y_stride) {
#if X86
    /* kvw_supported let the type through. Only the formats both kernels read take the AVX2 ones, so
     * a setting of as_avx2 changed after that check cannot send other blocks to a kernel that would
     * misread them. */
    if (is_q6_k(type)) { /* AVX2's kernel: there is no VNNI one */
        dots_q6_k_avx2(n, w, u, x, rows, y, y_stride);
        return;
    }
    if ((is_q8_0(type) || is_q4_k(type) || is_q4_1(type)) && !avx512_vnni()) {
        (is_q4_k(type) ? dots_q4_k_avx2 : is_q4_1(type) ? dots_q4_1_avx2 : dots_q8_0_avx2)(n, w, u, x, rows, y, y_stride);
        return;
    }
    if (!has_avx512_vnni()) return; /* unreachable: kvw_supported refused the type */
    (is_q4_k(type) ? dots_q4_k : is_q8_0(type) ? dots_q8_0 : is_q5_0(type) ? dots_q5_0 : dots_q4_1)(
        n, w, u, x, rows, y, y_stride);
#else  /* unreachable: kvw_supported refuses the x16 types where kvw_x16_supported(type) is 0 */
    (void)type, (void)n, (void)w, (void)u, (void)x, (void)rows, (void)y, (void)y_stride;
#endif
}
