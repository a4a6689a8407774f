/* Matrix products on the container's own q4 and q8 layouts (colibri-int4 FORMAT.md; q6, the LM head's
 * 6-bit one, further down):
 *
 *   q4: packed[n, j]  u8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high one
 *       w[n, k] = (q[n, k] - 8) * scales[n, k/G] (+ zeros[n, k/G])
 *   q8: data[n, k]    i8 [N, K];   w[n, k] = data[n, k] * scales[n, k/G]
 *   scales[n, g]  u16 bits of bf16 or fp16 [N, K/G];  zeros[n, g] the same, or absent
 *
 * so a missed expert is computed from the bytes read, with no repack. Activations are quantized
 * to int8 per block of 32 columns (one f32 scale each, as llama.cpp's q8_0). A block's dot
 * product is then one byte multiply-add over 32 lanes (AVX2 `vpmaddubsw`, unsigned nibbles by
 * signed activations; for signed q8 weights the sign moves onto the activations first), and the
 * -8 offset and the zeros are applied once per group from per-block sums of the activations.
 *
 * Every function has a portable scalar version; the AVX2 ones, and AVX-512 VNNI ones that compute
 * the same integer sums with fewer instructions (`vpdpbusd`), are compiled for their target only
 * (function attributes), so one shared object runs on any x86-64 and the caller picks the level.
 * Rows are split across OpenMP threads.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include "exp_f32.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include "transpose8.h"
#define COLIBRI_X86 1
/* level 2: AVX-512 VNNI instructions on 256-bit vectors (AVX-512VL) */
#define VNNI_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
/* within level 2, where the core also has AVX-512 BW and DQ (every AVX-512 VNNI core sold): one
 * activation row's products in 512-bit vectors, whose lanes run the 256-bit path's operations in
 * its order, so the same bits with half the instructions (`weight_rows_zmm`, `q8_row_pairs_zmm`) */
#define ZMM_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni"
static int zmm_ok(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("avx512vnni");
    }
    return known;
}
#endif

#define BLOCK 32
/* groups the pair paths take: a pair of blocks under one scale, or each block its own (PAIR_SCALE) */
#define PAIRED_GROUPS(per_group) ((per_group) % 2 == 0 || (per_group) == 1)

static inline float bf16_to_f32(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> single, exactly: a normal half is an integer add on its bits, a subnormal one (or
 * zero) a multiply of its mantissa by 2^-24, whose result is a normal float (nothing here depends
 * on the denormals-are-zero mode torch may set); infinity and NaN keep their bits. */
static inline float fp16_to_f32(uint16_t h) {
    uint32_t rest = h & 0x7fffu, u;
    float f;
    if (rest >= 0x7c00u) u = 0x7f800000u | ((rest & 0x3ffu) << 13);
    else if (rest >= 0x0400u) u = (rest << 13) + ((127u - 15u) << 23);
    else {
        f = (float)rest * 0x1p-24f;
        memcpy(&u, &f, 4);
    }
    u |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &u, 4);
    return f;
}

static inline float half_to_f32(uint16_t bits, int fp16) { return fp16 ? fp16_to_f32(bits) : bf16_to_f32(bits); }

/* Round to nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves no fraction bits, and the
 * default rounding mode rounds exactly as lrintf does (which gcc leaves a library call per value). */
static inline float round_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

#ifdef COLIBRI_X86
/* One block of colibri_q8_quantize in AVX2, with the scalar path's bits: the same max (an exact
 * operation in any order), the products rounded by the same mode (cvtps2dq: nearest, ties to
 * even) and clamped before packing. */
__attribute__((target("avx2,fma"))) static void quantize_block_avx2(const float *v, int8_t *q, float *dx,
                                                                     int32_t *xs) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
           v3 = _mm256_loadu_ps(v + 24);
    __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, magnitude), _mm256_and_ps(v1, magnitude)),
                               _mm256_max_ps(_mm256_and_ps(v2, magnitude), _mm256_and_ps(v3, magnitude)));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    float amax = _mm_cvtss_f32(_mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 1)));
    float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 scale = _mm256_set1_ps(inv);
    const __m256i high = _mm256_set1_epi32(127), low = _mm256_set1_epi32(-127);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, scale)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, scale)),
            i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, scale)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, scale));
    i0 = _mm256_max_epi32(_mm256_min_epi32(i0, high), low);
    i1 = _mm256_max_epi32(_mm256_min_epi32(i1, high), low);
    i2 = _mm256_max_epi32(_mm256_min_epi32(i2, high), low);
    i3 = _mm256_max_epi32(_mm256_min_epi32(i3, high), low);
    __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4e));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xb1));
    /* packs work within 128-bit halves: the permute puts the 32 bytes back in column order */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    *dx = d;
    *xs = _mm_cvtsi128_si32(sum4);
}
#endif

/* x [M, K] f32 -> xq [M, K] int8, dx [M, K/32] scales, xs [M, K/32] sums of xq (for the -8 of
 * every nibble and the zeros). K is a multiple of 32. A block's max runs in 8 lanes (column i in
 * lane i % 8), which the compiler can keep in vector registers. */
int colibri_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, int32_t *xs,
                        int8_t *pairs, float *pair_scales, int level) {
    if (K % BLOCK) return -1;
    int64_t blocks = K / BLOCK;
    for (int64_t m = 0; m < M; m++) {
#ifdef COLIBRI_X86
        if (level >= 1) {
            for (int64_t b = 0; b < blocks; b++)
                quantize_block_avx2(x + m * K + b * BLOCK, xq + m * K + b * BLOCK, dx + m * blocks + b,
                                    xs + m * blocks + b);
        } else
#endif
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + m * K + b * BLOCK;
            float lane_max[8] = {0};
            for (int i = 0; i < BLOCK; i += 8)
                for (int j = 0; j < 8; j++) {
                    float a = fabsf(v[i + j]);
                    lane_max[j] = a > lane_max[j] ? a : lane_max[j];
                }
            float amax = lane_max[0];
            for (int j = 1; j < 8; j++) amax = lane_max[j] > amax ? lane_max[j] : amax;
            float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int8_t *q = xq + m * K + b * BLOCK;
            int32_t sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                float r = round_even(v[i] * inv);
                r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
                q[i] = (int8_t)r;
                sum += (int32_t)r;
            }
            dx[m * blocks + b] = d;
            xs[m * blocks + b] = sum;
        }
        if (pairs && K % (2 * BLOCK) == 0) {
            /* per 64 columns (blocks 2p, 2p+1), in the order the q4 bytes unpack to:
             * 2p even, 2p+1 even, 2p odd, 2p+1 odd (16 each); scales 2p x4, 2p+1 x4 */
            for (int64_t p = 0; p < blocks / 2; p++) {
                const int8_t *q = xq + m * K + p * 2 * BLOCK;
                int8_t *out = pairs + m * K + p * 2 * BLOCK;
                for (int j = 0; j < 16; j++) {
                    out[j] = q[2 * j];
                    out[16 + j] = q[BLOCK + 2 * j];
                    out[32 + j] = q[2 * j + 1];
                    out[48 + j] = q[BLOCK + 2 * j + 1];
                }
                for (int i = 0; i < 8; i++) pair_scales[(m * blocks / 2 + p) * 8 + i] = dx[m * blocks + 2 * p + i / 4];
            }
        }
    }
    return 0;
}

/* Where a q4 or q8 matrix's bytes lie in memory (the container stores rows one after another):
 * - row-major: row n at n * row_bytes, its 64-byte chunks (q4: 128 columns, 4 blocks; q8: 64
 *   columns, 2 blocks) in turn;
 * - row tiles: 4 rows at a time with their chunks interleaved, chunk c of row 4t + r at
 *   4t * row_bytes + c * 256 + r * 64 (each tile the same bytes as its 4 rows row-major, permuted).
 * A one-token product reads 4 weight rows side by side; tiled, that is one sequential stream the
 * hardware prefetcher follows, where 4 rows 512 bytes apart kept it behind: a 143 MB q4 matrix of
 * 1024 columns streamed at 10.7-12.6 GB/s row-major and 19.5 GB/s tiled (one Zen 3 core, AVX2),
 * near what a plain sequential read gets there. Tiles need row_bytes % 64 == 0 and N % 4 == 0. A
 * row's chunks are `chunk` bytes apart (64 row-major, 256 tiled): block b of a q4 row at
 * Q4_BLOCK_AT(row, b, chunk), of a q8 row at Q8_BLOCK_AT. The callers pass the layout as bit 1 of
 * a matrix's `flags` (ROW_TILES; bit 0 says fp16 scales). */
#define ROW_TILES 2
#define Q4_BLOCK_AT(row, b, chunk) ((row) + ((b) >> 2) * (chunk) + ((b) & 3) * 16)
#define Q8_BLOCK_AT(row, b, chunk) ((row) + ((b) >> 1) * (chunk) + ((b) & 1) * 32)
typedef struct {
    int64_t row_bytes;
    int tiled;
} row_layout;
static inline const uint8_t *tiled_row(const uint8_t *p, int64_t n, row_layout layout) {
    return layout.tiled ? p + (n >> 2) * 4 * layout.row_bytes + (n & 3) * 64 : p + n * layout.row_bytes;
}
static inline int64_t row_chunk(row_layout layout) { return layout.tiled ? 256 : 64; }
/* the bytes between row n and row n + 1 of the same tile (row-major: between any two rows) */
static inline int64_t row_step(row_layout layout) { return layout.tiled ? 64 : layout.row_bytes; }
static inline int tileable(int64_t N, int64_t row_bytes) { return row_bytes % 64 == 0 && N % 4 == 0; }

/* A matrix of N rows of row_bytes from row-major `src` into row tiles at `dst` (or back,
 * `untile`); src may be dst (each tile then permuted through a copy). */
int colibri_tile_rows(const uint8_t *src, uint8_t *dst, int64_t N, int64_t row_bytes, int untile) {
    if (!tileable(N, row_bytes)) return -1;
    int64_t chunks = row_bytes / 64;
    uint8_t *copy = src == dst ? (uint8_t *)malloc((size_t)(4 * row_bytes)) : 0;
    if (src == dst && !copy) return -2;
    for (int64_t t = 0; t < N / 4; t++) {
        const uint8_t *from = src + t * 4 * row_bytes;
        uint8_t *to = dst + t * 4 * row_bytes;
        if (copy) {
            memcpy(copy, from, (size_t)(4 * row_bytes));
            from = copy;
        }
        for (int64_t r = 0; r < 4; r++)
            for (int64_t c = 0; c < chunks; c++) {
                int64_t rowwise = r * row_bytes + c * 64, tiled = c * 256 + r * 64;
                memcpy(to + (untile ? rowwise : tiled), from + (untile ? tiled : rowwise), 64);
            }
    }
    free(copy);
    return 0;
}

/* sum over the 32 columns of block b: q (0..15) * xq, as an int */
static inline int32_t block_dot_scalar(const uint8_t *p, const int8_t *q) {
    int32_t acc = 0;
    for (int j = 0; j < 16; j++) acc += (p[j] & 15) * q[2 * j] + (p[j] >> 4) * q[2 * j + 1];
    return acc;
}

/* A weight is scale * (nibble - 8) + zero, so a row's product with the int8 activations is, per group,
 * scale * sum(dx * (dot - 8 * xs)) + zero * sum(dx * xs): the zeros multiply the activations as the
 * kernel holds them (as the rest of the product does), not their float sums. */
static float row_scalar(const uint8_t *p, int64_t chunk, const uint16_t *s, const uint16_t *z, int fp16,
                        int64_t blocks, int64_t per_group, const int8_t *xq, const float *dx, const int32_t *xs) {
    float total = 0.f;
    for (int64_t g = 0; g * per_group < blocks; g++) {
        float acc = 0.f, xsum = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            acc += dx[b] * (float)(block_dot_scalar(Q4_BLOCK_AT(p, b, chunk), xq + b * BLOCK) - 8 * xs[b]);
            xsum += dx[b] * (float)xs[b];
        }
        total += acc * half_to_f32(s[g], fp16);
        if (z) total += xsum * half_to_f32(z[g], fp16);
    }
    return total;
}

#ifdef COLIBRI_X86
__attribute__((target("avx2,fma")))
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 8 16-bit scales or zeros -> f32 (bf16: a shift; fp16: F16C) */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 halves8_avx2(const uint16_t *h, int fp16) {
    __m128i bits = _mm_loadu_si128((const __m128i *)h);
    return fp16 ? _mm256_cvtph_ps(bits) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* 16-bit scales of one row -> f32, 8 at a time where they can be */
__attribute__((target("avx2,fma,f16c")))
static void row_scales_avx2(const uint16_t *s, int64_t groups, int fp16, float *out) {
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(out + g, halves8_avx2(s + g, fp16));
    for (; g < groups; g++) out[g] = half_to_f32(s[g], fp16);
}
#endif

/* A row's epilogue: per group g, minus coef[g] * offset[g], where offset[g] = 8 * sum(dx * xs) over the
 * group's blocks (the -8 of every nibble; act_row). A weight is scale * (nibble - 8) + zero, and the
 * zero times the group's int8 activations is zero * offset[g] / 8, so one coefficient carries both:
 * coef = scale - zero / 8, the scale alone without zeros (as llama.cpp's Q4_1 and Q4_K dot products
 * take the zeros through q8's block sums). Every path computes it with this one rounding (zero / 8 is
 * exact), so a row's result is the same bits on every path, and the zeros cost one subtraction per
 * group of a weight row instead of a dot product per activation row (a third of an asymmetric
 * prefill's expert time had gone to the zeros' and the -8's terms apart). */
static inline float epilogue_coefficient(float scale, float zero) { return scale - zero * 0.125f; }

#ifdef COLIBRI_X86
/* coef[i] = epilogue_coefficient(scales[i], zeros[i]) for n consecutive groups, 8 at a time (the same
 * two operations, so the same bits) */
__attribute__((target("avx2,fma,f16c")))
static void row_coefficients_avx2(const float *scales, const uint16_t *z, int64_t n, int fp16, float *coef) {
    const __m256 eighth = _mm256_set1_ps(0.125f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(coef + i, _mm256_sub_ps(_mm256_loadu_ps(scales + i),
                                                 _mm256_mul_ps(halves8_avx2(z + i, fp16), eighth)));
    for (; i < n; i++) coef[i] = epilogue_coefficient(scales[i], half_to_f32(z[i], fp16));
}

/* scalar[r] = 0 - coef[r][0] * offset[0] - coef[r][1] * offset[1] - ... for 4 weight rows (coef
 * [row][group], groups consecutive): the epilogue of `weight_rows_*` and `q6_rows_body`, with the rows
 * in the lanes of one vector, so lane r runs the scalar loop's multiplies and subtractions in its
 * order (the same bits). 8 groups at a time are transposed in registers. Written per row and
 * group, this loop was a sixth of a one-row q4 product's time on a Zen 3 core (the product itself
 * reads 32 bytes of weights per four vector multiplies). */
__attribute__((target("avx2,fma"))) static void epilogue_rows4(const float *coef, int64_t groups, const float *offset,
                                                              float *scalar) {
    __m128 lanes = _mm_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m256 r0 = _mm256_loadu_ps(coef + g), r1 = _mm256_loadu_ps(coef + groups + g);
        __m256 r2 = _mm256_loadu_ps(coef + 2 * groups + g), r3 = _mm256_loadu_ps(coef + 3 * groups + g);
        __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        /* column[k] holds groups g + k (low half) and g + 4 + k (high half), rows 0-3 in each */
        __m256 column[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                            _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
        for (int k = 0; k < 4; k++)
            lanes = _mm_sub_ps(lanes, _mm_mul_ps(_mm256_castps256_ps128(column[k]), _mm_set1_ps(offset[g + k])));
        for (int k = 0; k < 4; k++)
            lanes = _mm_sub_ps(lanes, _mm_mul_ps(_mm256_extractf128_ps(column[k], 1), _mm_set1_ps(offset[g + 4 + k])));
    }
    for (; g < groups; g++) {
        __m128 column = _mm_set_ps(coef[3 * groups + g], coef[2 * groups + g], coef[groups + g], coef[g]);
        lanes = _mm_sub_ps(lanes, _mm_mul_ps(column, _mm_set1_ps(offset[g])));
    }
    _mm_storeu_ps(scalar, lanes);
}

__attribute__((target("avx2,fma")))
static float row_avx2(const uint8_t *p, int64_t chunk, const uint16_t *s, const uint16_t *z, int fp16,
                      int64_t blocks, int64_t per_group, const int8_t *xq, const float *dx, const float *offset) {
    const __m128i low = _mm_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float scalar = 0.f;
    for (int64_t g = 0; g * per_group < blocks; g++) {
        float scale = half_to_f32(s[g], fp16);
        float coef = z ? epilogue_coefficient(scale, half_to_f32(z[g], fp16)) : scale;
        __m256 group = _mm256_setzero_ps();
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)Q4_BLOCK_AT(p, b, chunk));
            __m128i even = _mm_and_si128(raw, low), odd = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
            /* interleaved back into column order: columns 0..15, then 16..31 */
            __m256i w = _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
            __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
            group = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_set1_ps(dx[b]), group);
        }
        acc = _mm256_fmadd_ps(group, _mm256_set1_ps(scale), acc);
        scalar -= coef * offset[g];  /* the -8 of every nibble and the zero */
    }
    return hsum256(acc) + scalar;
}
#endif

static float row8_scalar(const int8_t *w, int64_t chunk, const uint16_t *s, int fp16, int64_t blocks,
                         int64_t per_group, const int8_t *xq, const float *dx) {
    float total = 0.f;
    for (int64_t g = 0; g * per_group < blocks; g++) {
        float acc = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            int32_t dot = 0;
            const int8_t *wb = Q8_BLOCK_AT(w, b, chunk);
            for (int i = 0; i < BLOCK; i++) dot += wb[i] * xq[b * BLOCK + i];
            acc += dx[b] * (float)dot;
        }
        total += acc * half_to_f32(s[g], fp16);
    }
    return total;
}

#ifdef COLIBRI_X86

/* |w| * (x with w's sign): unsigned by signed, as vpmaddubsw and vpdpbusd need (a -128 reads as
 * 128); the same int32 sums either way (2 x 128 x 127 < 2^15) */
#define Q8_DOT_AVX2(magnitude, signed_x) _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones)
#define Q8_DOT_VNNI(magnitude, signed_x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x)

/* R activation rows (1..4) times one q8 weight row; each row runs the one-row sequence exactly */
#define ROWS8(NAME, TARGET, DOT)                                                                               \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(                                    \
        const int8_t *w, int64_t chunk, const uint16_t *s, int fp16, int64_t blocks, int64_t per_group, int R,   \
        const int8_t *const *xq, const float *const *dx, float *const *out) {                                   \
        const __m256i ones = _mm256_set1_epi16(1);                                                              \
        (void)ones;                                                                                             \
        __m256 acc[4];                                                                                          \
        float scales[blocks / per_group];                                                                       \
        row_scales_avx2(s, blocks / per_group, fp16, scales);                                                   \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                               \
        for (int64_t g = 0; g * per_group < blocks; g++) {                                                      \
            __m256 group[4];                                                                                    \
            for (int r = 0; r < R; r++) group[r] = _mm256_setzero_ps();                                         \
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {                                     \
                __m256i wv = _mm256_loadu_si256((const __m256i *)Q8_BLOCK_AT(w, b, chunk));                     \
                __m256i magnitude = _mm256_sign_epi8(wv, wv);                                                   \
                for (int r = 0; r < R; r++) {                                                                   \
                    __m256i x = _mm256_loadu_si256((const __m256i *)(xq[r] + b * BLOCK));                       \
                    __m256i sums = DOT(magnitude, _mm256_sign_epi8(x, wv));                                     \
                    group[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(dx[r][b]), group[r]);   \
                }                                                                                               \
            }                                                                                                   \
            __m256 scale = _mm256_set1_ps(scales[g]);                                                           \
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(group[r], scale, acc[r]);                      \
        }                                                                                                       \
        for (int r = 0; r < R; r++) {                                                                           \
            __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));           \
            lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));                                                         \
            lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));                                                           \
            *out[r] = _mm_cvtss_f32(lo);                                                                        \
        }                                                                                                       \
    }

#define TILE8(NAME, TARGET, ROWS)                                                                              \
    __attribute__((target(TARGET))) static void NAME(const int8_t *w, int64_t chunk, const uint16_t *s,       \
                                                     int fp16, int64_t blocks, int64_t per_group, int R,        \
                                                     const int8_t *const *xq, const float *const *dx,           \
                                                     float *const *out) {                                       \
        switch (R) {                                                                                            \
        case 4: ROWS(w, chunk, s, fp16, blocks, per_group, 4, xq, dx, out); break;                                     \
        case 3: ROWS(w, chunk, s, fp16, blocks, per_group, 3, xq, dx, out); break;                                     \
        case 2: ROWS(w, chunk, s, fp16, blocks, per_group, 2, xq, dx, out); break;                                     \
        default: ROWS(w, chunk, s, fp16, blocks, per_group, 1, xq, dx, out); break;                                    \
        }                                                                                                       \
    }


/* One activation row times Q8_WROWS consecutive q8 weight rows (a decode token's head), each row
 * running exactly `rows8_*`'s one-row sequence (so the same bits), with the rows ahead prefetched
 * into L2: interleaved rows outrun the hardware prefetcher, as in q8_row_pairs_zmm. */
#define Q8_WROWS 4
#define Q8_PREFETCH_ROWS 8
#define Q8_WEIGHT_ROWS(NAME, TARGET, DOT)                                                                      \
    __attribute__((target(TARGET))) static void NAME(const int8_t *w, row_layout layout, const uint16_t *s,    \
                                                     int fp16, int64_t blocks, int64_t per_group,               \
                                                     const int8_t *xq, const float *dx, float *out) {           \
        const __m256i ones = _mm256_set1_epi16(1);                                                              \
        (void)ones;                                                                                             \
        const int64_t step = row_step(layout), chunk = row_chunk(layout);                                       \
        const int64_t ahead = Q8_PREFETCH_ROWS * layout.row_bytes;                                              \
        int64_t groups = blocks / per_group;                                                                    \
        __m256 acc[Q8_WROWS];                                                                                   \
        float scales[Q8_WROWS * groups]; /* the rows' scales, converted once (not once a group) */              \
        row_scales_avx2(s, Q8_WROWS * groups, fp16, scales);                                                    \
        for (int r = 0; r < Q8_WROWS; r++) acc[r] = _mm256_setzero_ps();                                        \
        for (int64_t g = 0; g < groups; g++) {                                                                  \
            __m256 group[Q8_WROWS];                                                                             \
            for (int r = 0; r < Q8_WROWS; r++) group[r] = _mm256_setzero_ps();                                  \
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {                                     \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));                              \
                __m256 d = _mm256_set1_ps(dx[b]);                                                               \
                if (!(b & 1))                                                                                   \
                    for (int r = 0; r < Q8_WROWS; r++)                                                          \
                        _mm_prefetch((const char *)Q8_BLOCK_AT(w + ahead + r * step, b, chunk), _MM_HINT_T1);   \
                for (int r = 0; r < Q8_WROWS; r++) {                                                            \
                    __m256i wv = _mm256_loadu_si256((const __m256i *)Q8_BLOCK_AT(w + r * step, b, chunk));      \
                    __m256i sums = DOT(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv));                      \
                    group[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, group[r]);                          \
                }                                                                                               \
            }                                                                                                   \
            for (int r = 0; r < Q8_WROWS; r++)                                                                  \
                acc[r] = _mm256_fmadd_ps(group[r], _mm256_set1_ps(scales[r * groups + g]), acc[r]);             \
        }                                                                                                       \
        for (int r = 0; r < Q8_WROWS; r++) {                                                                    \
            __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));           \
            lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));                                                         \
            lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));                                                           \
            out[r] = _mm_cvtss_f32(lo);                                                                         \
        }                                                                                                       \
    }

Q8_WEIGHT_ROWS(q8_weight_rows_avx2, "avx2,fma", Q8_DOT_AVX2)
Q8_WEIGHT_ROWS(q8_weight_rows_vnni, VNNI_TARGET, Q8_DOT_VNNI)

ROWS8(rows8_avx2, "avx2,fma", Q8_DOT_AVX2)
ROWS8(rows8_vnni, VNNI_TARGET, Q8_DOT_VNNI)
TILE8(tile8_avx2, "avx2,fma", rows8_avx2)
TILE8(tile8_vnni, VNNI_TARGET, rows8_vnni)

/* One activation row times two q8 weight rows w0, w1 (consecutive rows: w1 - w0 is a row) in
 * 512-bit vectors: the low half of every vector is w0's `rows8_vnni` sequence, the high half w1's
 * (the activation block broadcast to both), so each result is that path's bits. x's sign comes
 * from the weight's by a masked negation (no 512-bit vpsignb): where w is 0 the magnitude is 0, so
 * the int32 sums are vpsignb's. Without the prefetch a 32000 x 1024 head read cold took 3.7 ms
 * against 1.25 ms for the 256-bit path; with it 1.16 ms (AMD EPYC Zen 4, one thread). */
#define Q8_PREFETCH_PAIRS 4
/* w0, w1: two rows of one layout (`chunk`), `ahead` the bytes from a row to the one 8 rows on */
__attribute__((target(ZMM_TARGET))) static void q8_row_pairs_zmm(const int8_t *w0, const int8_t *w1, int64_t chunk,
                                                                 int64_t ahead,
                                                                 const uint16_t *s0, const uint16_t *s1, int fp16,
                                                                 int64_t blocks, int64_t per_group, const int8_t *xq,
                                                                 const float *dx, float *out0, float *out1) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    int64_t groups = blocks / per_group;
    float scales[2 * groups]; /* both rows' scales, converted once (fp16 one by one cost a fifth of a token) */
    row_scales_avx2(s0, groups, fp16, scales);
    row_scales_avx2(s1, groups, fp16, scales + groups);
    for (int64_t g = 0; g * per_group < blocks; g++) {
        __m512 group = _mm512_setzero_ps();
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            if (!(b & 1)) {  /* the pairs ahead, into L2: two interleaved rows outrun the hardware prefetcher */
                _mm_prefetch((const char *)Q8_BLOCK_AT(w0 + ahead, b, chunk), _MM_HINT_T1);
                _mm_prefetch((const char *)Q8_BLOCK_AT(w1 + ahead, b, chunk), _MM_HINT_T1);
            }
            __m256i low_row = _mm256_loadu_si256((const __m256i *)Q8_BLOCK_AT(w0, b, chunk));
            __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(low_row),
                                            _mm256_loadu_si256((const __m256i *)Q8_BLOCK_AT(w1, b, chunk)), 1);
            __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + b * BLOCK)));
            __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(wv), zero, x);
            __m512i sums = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), signed_x);
            group = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(dx[b]), group);
        }
        __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(scales[g]), _mm256_set1_ps(scales[groups + g]), 1);
        acc = _mm512_fmadd_ps(group, scale, acc);
    }
    *out0 = hsum256(_mm512_castps512_ps256(acc));
    *out1 = hsum256(_mm512_extractf32x8_ps(acc, 1));
}
#endif

/* y [M, N] f32 = x [M, K] @ w[N, K].T for q8 weights w (int8 [N, K], scales [N, K/G]): blocks of
 * 16 weight rows in parallel, activation rows 4 at a time over each block (weights read once). */
int colibri_q8w_matmul(const int8_t *xq, const float *dx, int64_t M, int64_t K, const int8_t *weights,
                       const uint16_t *scales, int flags, int64_t N, int64_t G, float *y, int threads, int level) {
    const row_layout layout = {K, (flags & ROW_TILES) != 0};
    const int fp16 = flags & 1;
    const int64_t chunk = row_chunk(layout);
    if (K % BLOCK || G % BLOCK || K % G || (layout.tiled && !tileable(N, K))) return -1;
#define Q8_ROW(n) ((const int8_t *)tiled_row((const uint8_t *)weights, (n), layout))
    int64_t blocks = K / BLOCK, per_group = G / BLOCK, groups = K / G;
#ifndef COLIBRI_X86
    level = 0;
#endif
    int64_t row_blocks = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t task = 0; task < row_blocks; task++) {
        int64_t n0 = task * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t m = 0; m < M; m += 4) {
            int R = M - m < 4 ? (int)(M - m) : 4;
            const int8_t *q[4];
            const float *d[4];
            for (int r = 0; r < R; r++) { q[r] = xq + (m + r) * K; d[r] = dx + (m + r) * blocks; }
            int64_t n = n0;
#ifdef COLIBRI_X86
            if (R == 1 && level >= 2 && zmm_ok())
                for (; n + 2 <= n1; n += 2)
                    q8_row_pairs_zmm(Q8_ROW(n), Q8_ROW(n + 1), chunk, Q8_PREFETCH_PAIRS * 2 * K, scales + n * groups,
                                     scales + (n + 1) * groups, fp16, blocks, per_group, q[0], d[0], y + m * N + n,
                                     y + m * N + n + 1);
            if (R == 1 && level >= 1)
                for (; n + Q8_WROWS <= n1; n += Q8_WROWS) {
                    if (level >= 2)
                        q8_weight_rows_vnni(Q8_ROW(n), layout, scales + n * groups, fp16, blocks, per_group, q[0],
                                            d[0], y + m * N + n);
                    else
                        q8_weight_rows_avx2(Q8_ROW(n), layout, scales + n * groups, fp16, blocks, per_group, q[0],
                                            d[0], y + m * N + n);
                }
#endif
            for (; n < n1; n++) {
                const int8_t *w = Q8_ROW(n);
                const uint16_t *s = scales + n * groups;
                float *out[4];
                for (int r = 0; r < R; r++) out[r] = y + (m + r) * N + n;
#ifdef COLIBRI_X86
                if (level >= 2) { tile8_vnni(w, chunk, s, fp16, blocks, per_group, R, q, d, out); continue; }
                if (level >= 1) { tile8_avx2(w, chunk, s, fp16, blocks, per_group, R, q, d, out); continue; }
#endif
                for (int r = 0; r < R; r++) *out[r] = row8_scalar(w, chunk, s, fp16, blocks, per_group, q[r], d[r]);
            }
        }
    }
    return 0;
}
#undef Q8_ROW

#ifdef COLIBRI_X86

/* Two blocks per step (a 32-byte load): for groups of 64 columns or more, with the activations
 * in pair order (colibri_q8_quantize's `pairs`). The row's scales are converted up front and
 * folded into each step's activation scales, so a group costs no more than its pairs.
 *
 * R activation rows (1..TILE) share each load and unpack of the weight row. Each row keeps its own
 * accumulators and runs exactly the one-row sequence of operations, so a row's result does not
 * depend on how many rows share the call (a padded batch, a prefill chunk, one decode token). */
#define TILE 4

/* The int32 sums of one step (4 bytes a lane: even nibbles x x0 plus odd nibbles x x1). AVX2
 * needs three multiply-adds and an add; AVX-512 VNNI's vpdpbusd does it in two, with the same
 * integers (no int16 step can saturate: 2 x 15 x 127 < 2^15), so both levels give the same bits. */
#define PAIR_DOT_AVX2(even, odd, x0, x1) \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(even, x0), _mm256_maddubs_epi16(odd, x1)), ones)
#define PAIR_DOT_VNNI(even, odd, x0, x1) \
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), even, x0), odd, x1)

/* One step of one weight row against one activation row (blocks b, b + 1: 32 bytes packed, split
 * into even and odd nibbles by SPLIT_NIBBLES): the int32 sums, scaled by d and added to the row's
 * accumulator for this half of the group. Every q4 path that pairs blocks runs exactly this, so
 * they give the same bits. */
#define SPLIT_NIBBLES(raw, even, odd)                                                                          \
    __m256i even = _mm256_and_si256(raw, low), odd = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)
#define PAIR_STEP(PAIR_DOT, even, odd, x0, x1, d, b, acc0, acc1)                                              \
    do {                                                                                                        \
        __m256 v_ = _mm256_cvtepi32_ps(PAIR_DOT(even, odd, x0, x1));                                            \
        if ((b) & 2) acc1 = _mm256_fmadd_ps(v_, d, acc1);                                                       \
        else acc0 = _mm256_fmadd_ps(v_, d, acc0);                                                               \
    } while (0)

/* The weight scales of a pair step (blocks b and b + 1, b even: lanes 0-3 and 4-7 of its dot
 * sums; g = b / per_group): one broadcast where both blocks share a group (groups of 64 or more),
 * each block its own in groups of 32 (llama.cpp's Q4_0 / Q4_1 block size). The pair paths take
 * either (PAIRED_GROUPS). */
#define PAIR_SCALE(scales, g, per_group)                                                                       \
    ((per_group) == 1 ? _mm256_set_m128(_mm_set1_ps((scales)[(g) + 1]), _mm_set1_ps((scales)[g]))              \
                      : _mm256_set1_ps((scales)[g]))

/* WITH_PER_GROUP(per_group, statements): the statements with `pg` the blocks per group, a constant
 * in the common cases (groups of 32, 64, 128), so a step's group is a shift rather than a 64-bit
 * division: one division per weight row and step had cost a decode token's experts 5-10% on a
 * Zen 3 core (AVX2), where such a division takes 10-20 cycles. */
#define WITH_PER_GROUP(per_group, ...)                                                                         \
    switch (per_group) {                                                                                       \
    case 1: { const int64_t pg = 1; __VA_ARGS__; } break;                                                      \
    case 2: { const int64_t pg = 2; __VA_ARGS__; } break;                                                      \
    case 4: { const int64_t pg = 4; __VA_ARGS__; } break;                                                      \
    default: { const int64_t pg = (per_group); __VA_ARGS__; } break;                                           \
    }

/* rows_pairs_<level>(p, scales, coef, blocks, per_group, R, pairs, pair_scales, offset, out, with_epilogue):
 * coef, the epilogue coefficients (the scales themselves without zeros) */
#define ROWS_PAIRS(NAME, TARGET, PAIR_DOT)                                                                     \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(                                    \
        const uint8_t *p, int64_t chunk, const float *scales, const float *coef, int64_t blocks,                 \
        int64_t per_group, int R,                                                                                \
        const int8_t *const *pairs, const float *const *pair_scales, const float *const *offset,                 \
        float *const *out, const int with_epilogue) {                                                           \
        const __m256i low = _mm256_set1_epi8(15);                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                                              \
        (void)ones;                                                                                             \
        int64_t groups = blocks / per_group;                                                                    \
        __m256 acc0[TILE], acc1[TILE];                                                                          \
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();                                    \
        /* two steps an iteration (blocks b, b + 1 into acc0, b + 2, b + 3 into acc1), as                       \
         * weight_rows_* runs them: no branch on which accumulator a step feeds */                              \
        int64_t b = 0;                                                                                          \
        for (; b + 4 <= blocks; b += 4) {                                                                       \
            __m256 scale0 = PAIR_SCALE(scales, b / per_group, per_group);                                       \
            __m256 scale1 = PAIR_SCALE(scales, (b + 2) / per_group, per_group);                                 \
            __m256i raw0 = _mm256_loadu_si256((const __m256i *)Q4_BLOCK_AT(p, b, chunk));                       \
            __m256i raw1 = _mm256_loadu_si256((const __m256i *)(Q4_BLOCK_AT(p, b, chunk) + 32));                 \
            SPLIT_NIBBLES(raw0, even0, odd0);                                                                   \
            SPLIT_NIBBLES(raw1, even1, odd1);                                                                   \
            for (int r = 0; r < R; r++) {                                                                       \
                const int8_t *x = pairs[r] + b * BLOCK;                                                         \
                __m256 d0 = _mm256_mul_ps(_mm256_loadu_ps(pair_scales[r] + (b / 2) * 8), scale0);               \
                acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_DOT(even0, odd0,                              \
                    _mm256_loadu_si256((const __m256i *)x), _mm256_loadu_si256((const __m256i *)(x + 32)))),    \
                    d0, acc0[r]);                                                                               \
                __m256 d1 = _mm256_mul_ps(_mm256_loadu_ps(pair_scales[r] + (b / 2) * 8 + 8), scale1);           \
                acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_DOT(even1, odd1,                              \
                    _mm256_loadu_si256((const __m256i *)(x + 64)),                                              \
                    _mm256_loadu_si256((const __m256i *)(x + 96)))),                                            \
                    d1, acc1[r]);                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        if (b < blocks) { /* a last step of two blocks (b % 4 == 0: acc0's) */                                  \
            __m256 scale = PAIR_SCALE(scales, b / per_group, per_group);                                        \
            __m256i raw = _mm256_loadu_si256((const __m256i *)Q4_BLOCK_AT(p, b, chunk));                        \
            SPLIT_NIBBLES(raw, even, odd);                                                                      \
            for (int r = 0; r < R; r++) {                                                                       \
                const int8_t *x = pairs[r] + b * BLOCK;                                                         \
                __m256 d = _mm256_mul_ps(_mm256_loadu_ps(pair_scales[r] + (b / 2) * 8), scale);                 \
                PAIR_STEP(PAIR_DOT, even, odd, _mm256_loadu_si256((const __m256i *)x),                          \
                          _mm256_loadu_si256((const __m256i *)(x + 32)), d, b, acc0[r], acc1[r]);               \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < R; r++) {                                                                           \
            float scalar = 0.f;                                                                                 \
            for (int64_t g = 0; with_epilogue && g < groups; g++)                                               \
                scalar -= coef[g] * offset[r][g]; /* the -8 of every nibble and the zero */                     \
            __m256 both = _mm256_add_ps(acc0[r], acc1[r]);                                                      \
            __m128 lo = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));               \
            lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));                                                         \
            lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));                                                           \
            *out[r] = with_epilogue ? _mm_cvtss_f32(lo) + scalar : _mm_cvtss_f32(lo);                           \
        }                                                                                                       \
    }

ROWS_PAIRS(rows_pairs_avx2, "avx2,fma,f16c", PAIR_DOT_AVX2)
ROWS_PAIRS(rows_pairs_vnni, VNNI_TARGET, PAIR_DOT_VNNI)

/* the tile sizes as constants, so the compiler keeps every row's accumulators in registers */
#define TILE_PAIRS(NAME, TARGET, ROWS)                                                                         \
    __attribute__((target(TARGET))) static void NAME(                                                          \
        const uint8_t *p, int64_t chunk, const uint16_t *s, const uint16_t *z, int fp16, int64_t blocks,        \
        int64_t per_group, int R, const int8_t *const *pairs, const float *const *pair_scales,                  \
        const float *const *offset, float *const *out) {                                                        \
        int64_t groups = blocks / per_group;                                                                    \
        float scales[groups], coef[groups];                                                                     \
        row_scales_avx2(s, groups, fp16, scales);                                                               \
        if (z) row_coefficients_avx2(scales, z, groups, fp16, coef);                                            \
        const float *epi = z ? coef : scales;                                                                   \
        WITH_PER_GROUP(per_group, switch (R) {                                                                  \
            case 4: ROWS(p, chunk, scales, epi, blocks, pg, 4, pairs, pair_scales, offset, out, 1); break;             \
            case 3: ROWS(p, chunk, scales, epi, blocks, pg, 3, pairs, pair_scales, offset, out, 1); break;             \
            case 2: ROWS(p, chunk, scales, epi, blocks, pg, 2, pairs, pair_scales, offset, out, 1); break;             \
            default: ROWS(p, chunk, scales, epi, blocks, pg, 1, pairs, pair_scales, offset, out, 1); break;            \
        })                                                                                                      \
    }

TILE_PAIRS(tile_pairs_avx2, "avx2,fma,f16c", rows_pairs_avx2)
TILE_PAIRS(tile_pairs_vnni, VNNI_TARGET, rows_pairs_vnni)

/* The dot sums alone of one weight row (its scales already f32) times R activation rows, without
 * the epilogue: `block_rows` adds the epilogues of 8 weight rows at once afterwards. */
#define TILE_DOTS(NAME, TARGET, ROWS)                                                                           \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *p, int64_t chunk, const float *scales,      \
                                                     int64_t blocks, int64_t per_group, int R,                  \
                                                     const int8_t *const *pairs,                                \
                                                     const float *const *pair_scales, float *const *out) {      \
        WITH_PER_GROUP(per_group, switch (R) {                                                                  \
            case 4: ROWS(p, chunk, scales, 0, blocks, pg, 4, pairs, pair_scales, 0, out, 0); break;                    \
            case 3: ROWS(p, chunk, scales, 0, blocks, pg, 3, pairs, pair_scales, 0, out, 0); break;                    \
            case 2: ROWS(p, chunk, scales, 0, blocks, pg, 2, pairs, pair_scales, 0, out, 0); break;                    \
            default: ROWS(p, chunk, scales, 0, blocks, pg, 1, pairs, pair_scales, 0, out, 0); break;                   \
        })                                                                                                      \
    }

TILE_DOTS(tile_dots_avx2, "avx2,fma,f16c", rows_pairs_avx2)
TILE_DOTS(tile_dots_vnni, VNNI_TARGET, rows_pairs_vnni)

/* One activation row times WROWS consecutive weight rows (a decode token's expert): the rows share
 * each load of the activations and their scales, and their epilogues run side by side. Each weight
 * row runs exactly the sequence `rows_pairs_*` runs for it (the same accumulators, the same order
 * of every sum), so a row's result is the same bits whichever path computes it.
 *
 * A decode token streams its experts from memory once, and there the arithmetic alone is not the
 * limit: the rows ahead are prefetched (PREFETCH_ROWS, a few KB), which the hardware prefetcher
 * does not do by itself for four interleaved rows, into L2 rather than L1 (T1): L1's few miss
 * buffers capped the reads in flight. A token's experts of a 24 x 64 Qwen3-MoE shape (192 experts
 * of 1024 x 1024 gate|up and 1024 x 512 down, read cold, AMD EPYC Zen 4, one thread): T0 17.4 ms,
 * T1 11.0 ms; the prefetch distance from 8 to 40 rows within 5%. */
#define WROWS 4
#define PREFETCH_ROWS 16
#define WEIGHT_ROWS_PAIRS(NAME, TARGET, PAIR_DOT)                                                              \
    __attribute__((target(TARGET), always_inline)) static inline void NAME##_body(                            \
        const uint8_t *p, row_layout layout, const uint16_t *s, const uint16_t *z, int fp16, int64_t blocks,   \
        const int64_t per_group, const int8_t *pairs, const float *pair_scales, const float *offset,            \
        float *out) {                                                                                           \
        const int64_t step = row_step(layout), chunk = row_chunk(layout), ahead = PREFETCH_ROWS * layout.row_bytes; \
        const __m256i low = _mm256_set1_epi8(15);                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                                              \
        (void)ones;                                                                                             \
        int64_t groups = blocks / per_group;                                                                    \
        float scales[WROWS * groups], coef[WROWS * groups];                                                     \
        row_scales_avx2(s, WROWS * groups, fp16, scales); /* the rows' scales are consecutive */                \
        if (z) row_coefficients_avx2(scales, z, WROWS * groups, fp16, coef);                                    \
        const float *epi = z ? coef : scales;                                                                   \
        __m256 acc0[WROWS], acc1[WROWS];                                                                        \
        for (int r = 0; r < WROWS; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();                                \
        /* two steps an iteration (blocks b, b + 1 into acc0, b + 2, b + 3 into acc1): no branch on             \
         * which accumulator a step feeds, so they all stay in registers */                                     \
        int64_t b = 0;                                                                                          \
        for (; b + 4 <= blocks; b += 4) {                                                                       \
            __m256 ps0 = _mm256_loadu_ps(pair_scales + (b / 2) * 8);                                            \
            __m256 ps1 = _mm256_loadu_ps(pair_scales + (b / 2) * 8 + 8);                                        \
            const int64_t g0 = b / per_group, g1 = (b + 2) / per_group;                                         \
            for (int r = 0; r < WROWS; r++)                                                                     \
                _mm_prefetch((const char *)(p + ahead + r * step + (b >> 2) * chunk), _MM_HINT_T1);             \
            for (int r = 0; r < WROWS; r++) {                                                                   \
                const uint8_t *w = p + r * step + (b >> 2) * chunk;                                             \
                __m256i raw0 = _mm256_loadu_si256((const __m256i *)w);                                          \
                SPLIT_NIBBLES(raw0, even0, odd0);                                                               \
                __m256 d0 = _mm256_mul_ps(ps0, PAIR_SCALE(scales + r * groups, g0, per_group));                 \
                acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_DOT(even0, odd0,                              \
                    _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK)),                                   \
                    _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 32)))), d0, acc0[r]);             \
                __m256i raw1 = _mm256_loadu_si256((const __m256i *)(w + 32));                                   \
                SPLIT_NIBBLES(raw1, even1, odd1);                                                               \
                __m256 d1 = _mm256_mul_ps(ps1, PAIR_SCALE(scales + r * groups, g1, per_group));                 \
                acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_DOT(even1, odd1,                              \
                    _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 64)),                              \
                    _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 96)))), d1, acc1[r]);             \
            }                                                                                                   \
        }                                                                                                       \
        if (b < blocks) { /* a last step of two blocks (b % 4 == 0: acc0's) */                                  \
            __m256 ps0 = _mm256_loadu_ps(pair_scales + (b / 2) * 8);                                            \
            for (int r = 0; r < WROWS; r++) {                                                                   \
                __m256i raw = _mm256_loadu_si256((const __m256i *)(p + r * step + (b >> 2) * chunk));           \
                SPLIT_NIBBLES(raw, even, odd);                                                                  \
                __m256 d = _mm256_mul_ps(ps0, PAIR_SCALE(scales + r * groups, b / per_group, per_group));       \
                PAIR_STEP(PAIR_DOT, even, odd, _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK)),        \
                          _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 32)), d, b, acc0[r], acc1[r]); \
            }                                                                                                   \
        }                                                                                                       \
        float scalar[WROWS];                                                                                    \
        epilogue_rows4(epi, groups, offset, scalar); /* the -8 of every nibble and the zero */                  \
        for (int r = 0; r < WROWS; r++) {                                                                       \
            __m256 both = _mm256_add_ps(acc0[r], acc1[r]);                                                      \
            __m128 lo = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));               \
            lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));                                                         \
            lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));                                                           \
            out[r] = _mm_cvtss_f32(lo) + scalar[r];                                                             \
        }                                                                                                       \
    }                                                                                                           \
    __attribute__((target(TARGET))) static void NAME(                                                          \
        const uint8_t *p, row_layout layout, const uint16_t *s, const uint16_t *z, int fp16, int64_t blocks,   \
        int64_t per_group, const int8_t *pairs, const float *pair_scales, const float *offset, float *out) {    \
        WITH_PER_GROUP(per_group, NAME##_body(p, layout, s, z, fp16, blocks, pg, pairs, pair_scales, offset,    \
                                              out))                                                             \
    }

WEIGHT_ROWS_PAIRS(weight_rows_avx2, "avx2,fma,f16c", PAIR_DOT_AVX2)
WEIGHT_ROWS_PAIRS(weight_rows_vnni, VNNI_TARGET, PAIR_DOT_VNNI)

/* The same one-activation-row product in 512-bit vectors, for AVX-512 cores (BW, DQ, VNNI): one
 * zmm holds two steps of `weight_rows_*` (blocks b, b + 1 in its low half, b + 2, b + 3 in its high
 * half), and its low and high halves are exactly that path's acc0 and acc1, so every lane runs the
 * same operations in the same order and a row's result is the same bits. Half the instructions a
 * weight row, and ZROWS rows share each activation load. A last step of two blocks (blocks % 4 == 2)
 * runs in the low lanes alone, as that path's acc0 step. */
#define ZROWS 8

/* The epilogue of ZROWS weight rows with the rows in the lanes of one vector: lane r runs exactly
 * the scalar loop's multiplies and subtractions in its order, so the same bits, in a sixth of the
 * instructions (it was an eighth of a decode token's expert time). The rows' coefficients
 * [row][group] are first transposed to [group][row], 8 groups at a time in registers and the last
 * groups % 8 one by one (SmolLM2's 576 columns are 9 groups of 64, 18 of 32: had the scalar loop
 * run there, it took most of a prefill's time in groups of 32 with zeros). */
__attribute__((target("avx2,fma"))) static void transpose_rows8(const float *rows, int64_t groups, float *out) {
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m256 in[8], columns[8];
        for (int r = 0; r < 8; r++) in[r] = _mm256_loadu_ps(rows + r * groups + g);
        transpose8_ps(in, columns);
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + (g + c) * ZROWS, columns[c]);
    }
    for (; g < groups; g++)
        for (int r = 0; r < 8; r++) out[g * ZROWS + r] = rows[r * groups + g];
}

/* scalar[r] = the epilogue sum of row r from the transposed coefficients [group][row] */
__attribute__((target("avx2,fma"))) static void epilogue_lanes(const float *coef_t, int64_t groups,
                                                              const float *offset, float *scalar) {
    __m256 lanes = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        lanes = _mm256_sub_ps(lanes, _mm256_mul_ps(_mm256_loadu_ps(coef_t + g * ZROWS), _mm256_set1_ps(offset[g])));
    _mm256_storeu_ps(scalar, lanes);
}

/* ZROWS weight rows times R activation rows (R <= ZACTS) in 512-bit vectors. One row (a decode
 * token's expert, streamed from memory: `prefetch` the rows ahead) or several (an expert's rows of a
 * prefill chunk, whose block of weight rows stays in L1 while every row passes over it). Each
 * (weight row, activation row) pair runs the same sequence whatever R, so a row's result is the
 * same bits alone or with others; the R rows share each weight load, its nibble split and its
 * scales. On a Zen 4 core, one thread, a 1024 x 1024 matrix in groups of 64 times 64 rows: 39.5
 * GMAC/s with the 256-bit tiles, 69.3 with 4 rows a call (2: 61.8; 6: 68.7). */
#define ZACTS 4
/* ZROWS weight rows' scales as weight_rows_zmm_body reads them: f32 (padded with 16 zeros: a step's
 * scales load 16 from its group), and their epilogue coefficients transposed for epilogue_lanes. A
 * prefill chunk's activation tiles share one conversion per block of weight rows. */
__attribute__((target("avx2,fma,f16c"))) static void zmm_row_scales(const uint16_t *s, const uint16_t *z, int fp16,
                                                                    int64_t groups, float *scales, float *coef_t) {
    row_scales_avx2(s, ZROWS * groups, fp16, scales);
    for (int i = 0; i < 16; i++) scales[ZROWS * groups + i] = 0.f;
    if (z) {
        float coef[ZROWS * groups];
        row_coefficients_avx2(scales, z, ZROWS * groups, fp16, coef);
        transpose_rows8(coef, groups, coef_t);
    } else
        transpose_rows8(scales, groups, coef_t);
}

__attribute__((target(ZMM_TARGET), always_inline)) static inline void weight_rows_zmm_body(
    const uint8_t *p, row_layout layout, const float *scales, const float *coef_t, int64_t blocks,
    int64_t per_group, const int8_t *const *pairs, const float *const *pair_scales, const float *const *offset,
    float *const *out, const int R, const int prefetch) {
    const uint8_t *row[ZROWS];
    for (int r = 0; r < ZROWS; r++) row[r] = tiled_row(p, r, layout);
    const int64_t chunk = row_chunk(layout), ahead = PREFETCH_ROWS * layout.row_bytes;
    const __m512i low = _mm512_set1_epi8(15);
    /* a step's scales: lanes 0-7 group g0's, 8-15 group g1's (g0 or the next); in groups of 32,
     * lanes 4k..4k+3 block b + k's */
    const __m512i one_group = _mm512_setzero_si512();
    const __m512i two_groups = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);
    const __m512i four_groups = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    int64_t groups = blocks / per_group;
    __m512 acc[ZACTS][ZROWS];
    for (int a = 0; a < R; a++)
        for (int r = 0; r < ZROWS; r++) acc[a][r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) {
        __m512i x0[ZACTS], x1[ZACTS];
        __m512 ps[ZACTS];
        for (int a = 0; a < R; a++) {
            const int8_t *x = pairs[a] + b * BLOCK;
            x0[a] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x)),
                                       _mm256_loadu_si256((const __m256i *)(x + 64)), 1);
            x1[a] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 32))),
                                       _mm256_loadu_si256((const __m256i *)(x + 96)), 1);
            ps[a] = _mm512_loadu_ps(pair_scales[a] + (b / 2) * 8);
        }
        int64_t g0 = b / per_group, g1 = (b + 2) / per_group;
        if (prefetch)
            for (int r = 0; r < ZROWS; r++)
                _mm_prefetch((const char *)(row[r] + ahead + (b >> 2) * chunk), _MM_HINT_T1);
        for (int r = 0; r < ZROWS; r++) {
            __m512i raw = _mm512_loadu_si512((const void *)(row[r] + (b >> 2) * chunk));
            __m512i even = _mm512_and_si512(raw, low), odd = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            __m512 scale = _mm512_permutexvar_ps(per_group == 1 ? four_groups : g1 > g0 ? two_groups : one_group,
                                                 _mm512_loadu_ps(scales + r * groups + g0));
            for (int a = 0; a < R; a++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, x0[a]), odd,
                                                  x1[a]);
                acc[a][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ps[a], scale), acc[a][r]);
            }
        }
    }
    if (b < blocks) {
        /* a last step of two blocks (blocks % 4 == 2: SmolLM2's 576 columns are 18): the 256-bit
         * path's acc0 step, so the low lanes only, loaded 256 bits wide (nothing read past a row) */
        __m512i x0[ZACTS], x1[ZACTS];
        __m512 ps[ZACTS];
        for (int a = 0; a < R; a++) {
            const int8_t *x = pairs[a] + b * BLOCK;
            x0[a] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)x));
            x1[a] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 32)));
            ps[a] = _mm512_zextps256_ps512(_mm256_loadu_ps(pair_scales[a] + (b / 2) * 8));
        }
        int64_t g0 = b / per_group;
        for (int r = 0; r < ZROWS; r++) {
            __m512i raw = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(row[r] + (b >> 2) * chunk)));
            __m512i even = _mm512_and_si512(raw, low), odd = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            __m512 scale = _mm512_permutexvar_ps(per_group == 1 ? four_groups : one_group,
                                                 _mm512_loadu_ps(scales + r * groups + g0));
            for (int a = 0; a < R; a++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, x0[a]), odd,
                                                  x1[a]);
                acc[a][r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ps[a], scale), acc[a][r],
                                                  0x00FF);
            }
        }
    }
    for (int a = 0; a < R; a++) {
        float scalar[ZROWS];
        epilogue_lanes(coef_t, groups, offset[a], scalar);
        for (int r = 0; r < ZROWS; r++)
            out[a][r] = hsum256(_mm256_add_ps(_mm512_castps512_ps256(acc[a][r]), _mm512_extractf32x8_ps(acc[a][r], 1)))
                        + scalar[r];
    }
}
__attribute__((target(ZMM_TARGET))) static void weight_rows_zmm(
    const uint8_t *p, row_layout layout, const uint16_t *s, const uint16_t *z, int fp16, int64_t blocks,
    int64_t per_group, const int8_t *pairs, const float *pair_scales, const float *offset, float *out) {
    int64_t groups = blocks / per_group;
    float scales[ZROWS * groups + 16], coef_t[ZROWS * groups];
    zmm_row_scales(s, z, fp16, groups, scales, coef_t);
    weight_rows_zmm_body(p, layout, scales, coef_t, blocks, per_group, &pairs, &pair_scales, &offset, &out, 1, 1);
}
#endif

/* One activation row as the kernel reads it (pointers into colibri_q8_quantize's output), with the
 * per-group sums every weight row shares: offset[g] = 8 * sum(dx * xs). */
typedef struct {
    const int8_t *q, *pairs;
    const float *dx, *pair_scales;
    const int32_t *xs;
    float *offset;
} act_row;

static void act_row_init(act_row *a, const int8_t *xq, const float *dx, const int32_t *xs, const int8_t *pairs,
                         const float *pair_scales, int64_t m, int64_t K, int64_t per_group, int64_t groups,
                         float *sums) {
    int64_t blocks = K / BLOCK;
    a->q = xq + m * K;
    a->dx = dx + m * blocks;
    a->xs = xs + m * blocks;
    a->pairs = pairs ? pairs + m * K : 0;
    a->pair_scales = pair_scales ? pair_scales + m * blocks * 4 : 0;
    a->offset = sums;
    for (int64_t g = 0; g < groups; g++) {
        float o = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) o += 8.f * a->dx[b] * (float)a->xs[b];
        a->offset[g] = o;
    }
}

#ifdef COLIBRI_X86
__attribute__((target(ZMM_TARGET))) static void weight_rows_zmm_acts(
    const uint8_t *p, row_layout layout, const float *s, const float *coef_t, int64_t blocks, int64_t per_group,
    const act_row *const *acts, int R, float *const *out) {
    const int8_t *pairs[ZACTS];
    const float *pair_scales[ZACTS], *offset[ZACTS];
    for (int a = 0; a < R; a++) {
        pairs[a] = acts[a]->pairs;
        pair_scales[a] = acts[a]->pair_scales;
        offset[a] = acts[a]->offset;
    }
    if (R == 4)
        weight_rows_zmm_body(p, layout, s, coef_t, blocks, per_group, pairs, pair_scales, offset, out, 4, 0);
    else if (R == 3)
        weight_rows_zmm_body(p, layout, s, coef_t, blocks, per_group, pairs, pair_scales, offset, out, 3, 0);
    else if (R == 2)
        weight_rows_zmm_body(p, layout, s, coef_t, blocks, per_group, pairs, pair_scales, offset, out, 2, 0);
    else
        weight_rows_zmm_body(p, layout, s, coef_t, blocks, per_group, pairs, pair_scales, offset, out, 1, 0);
}
#endif

/* rows `acts[0..R)` times one q4 weight row, each result to *out[r] */
static void q4_tile(const act_row *const *acts, int R, const uint8_t *p, int64_t chunk, const uint16_t *s,
                    const uint16_t *z, int fp16, int64_t blocks, int64_t per_group, float *const *out, int level) {
#ifdef COLIBRI_X86
    if (level >= 1 && acts[0]->pairs && PAIRED_GROUPS(per_group)) {
        const int8_t *pairs[TILE];
        const float *pair_scales[TILE], *offset[TILE];
        for (int r = 0; r < R; r++) {
            pairs[r] = acts[r]->pairs;
            pair_scales[r] = acts[r]->pair_scales;
            offset[r] = acts[r]->offset;
        }
        if (level >= 2) tile_pairs_vnni(p, chunk, s, z, fp16, blocks, per_group, R, pairs, pair_scales, offset, out);
        else tile_pairs_avx2(p, chunk, s, z, fp16, blocks, per_group, R, pairs, pair_scales, offset, out);
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        const act_row *a = acts[r];
#ifdef COLIBRI_X86
        if (level >= 1) { *out[r] = row_avx2(p, chunk, s, z, fp16, blocks, per_group, a->q, a->dx, a->offset); continue; }
#endif
        *out[r] = row_scalar(p, chunk, s, z, fp16, blocks, per_group, a->q, a->dx, a->xs);
    }
}

/* Weight rows per step of the parallel loop: about 8 KB of q4 at 1024 columns, so a block stays in
 * L1 while every activation row passes over it (the weights are read from memory once). */
#define ROW_BLOCK 16

#ifdef COLIBRI_X86
/* An expert's activation rows (more than one: a prefill chunk's) times a block of ROW_BLOCK weight
 * rows, at the 256-bit levels: first every row's dot sums (`tile_dots_*`, TILE activation rows
 * sharing each weight load), then the epilogues with 8 weight rows in the lanes of one vector
 * (`epilogue_lanes`: each lane runs the scalar loop's operations in its order, so the same bits as
 * `tile_pairs_*`). The scalar epilogue, per weight row and activation tile, had been a quarter of
 * this path's time. Needs a full block. */
static void block_rows(const uint8_t *p, row_layout layout, const uint16_t *s, const uint16_t *z, int fp16,
                       int64_t blocks, int64_t per_group, const act_row *acts, const int64_t *rows, int64_t count,
                       float *y, int64_t N, int level) {
    int64_t groups = blocks / per_group, size = ROW_BLOCK * groups;
    float scales[size], coef[size], coef_t[size];
    row_scales_avx2(s, size, fp16, scales); /* the block's rows' scales are consecutive */
    if (z) row_coefficients_avx2(scales, z, size, fp16, coef);
    for (int64_t h = 0; h < ROW_BLOCK; h += 8)
        transpose_rows8((z ? coef : scales) + h * groups, groups, coef_t + h * groups);
    for (int64_t i = 0; i < count; i += TILE) {
        int R = count - i < TILE ? (int)(count - i) : TILE;
        const int8_t *pairs[TILE];
        const float *pair_scales[TILE];
        for (int r = 0; r < R; r++) {
            pairs[r] = acts[rows[i + r]].pairs;
            pair_scales[r] = acts[rows[i + r]].pair_scales;
        }
        for (int64_t n = 0; n < ROW_BLOCK; n++) {
            float *out[TILE];
            for (int r = 0; r < R; r++) out[r] = y + (i + r) * N + n;
            const uint8_t *row = tiled_row(p, n, layout);
            if (level >= 2) tile_dots_vnni(row, row_chunk(layout), scales + n * groups, blocks, per_group, R, pairs,
                                           pair_scales, out);
            else tile_dots_avx2(row, row_chunk(layout), scales + n * groups, blocks, per_group, R, pairs, pair_scales,
                                out);
        }
        for (int r = 0; r < R; r++) {
            const act_row *a = &acts[rows[i + r]];
            for (int64_t h = 0; h < ROW_BLOCK; h += 8) {
                float scalar[8], *row = y + (i + r) * N + h;
                epilogue_lanes(coef_t + h * groups, groups, a->offset, scalar);
                for (int l = 0; l < 8; l++) row[l] += scalar[l];
            }
        }
    }
}
#endif

/* The first task (e * row_blocks + block of matrix e's weight rows) at or after `cost` in the running
 * sum of task costs, a task of matrix e costing its activation rows plus one (its weights' read;
 * nothing where it has no rows). */
static int64_t task_at_cost(const int64_t *row_start, int64_t E, int64_t row_blocks, int64_t cost) {
    int64_t sum = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t rows = row_start[e + 1] - row_start[e], each = rows ? rows + 1 : 0, all = each * row_blocks;
        if (sum + all > cost) return e * row_blocks + (cost - sum + each - 1) / each;
        sum += all;
    }
    return E * row_blocks;
}

/* The products of E weight matrices (the same shape [N, K], group G) with activation rows:
 * matrix e takes rows rows_of[e][0..count[e]) of the quantized activations, and its results go
 * to y + first_out[e] * N, one row of N per activation row. Rows of all the matrices share one
 * parallel loop, so the experts of one token (E matrices, one row each) keep every thread busy. */
static int q4_products(const int8_t *xq, const float *dx, const int32_t *xs, const int8_t *pairs,
                       const float *pair_scales, int64_t M, int64_t K, int64_t E, const uint8_t *const *packed,
                       const uint16_t *const *scales, const uint16_t *const *zeros, const int64_t *act_rows,
                       const int64_t *row_start, int flags, int64_t N, int64_t G, float *y, int threads, int level) {
    const row_layout layout = {K / 2, (flags & ROW_TILES) != 0};
    const int fp16 = flags & 1;
    if (K % BLOCK || G % BLOCK || K % G || (layout.tiled && !tileable(N, K / 2))) return -1;
    int64_t blocks = K / BLOCK, per_group = G / BLOCK, groups = K / G;
#ifndef COLIBRI_X86
    level = 0;
#endif
    /* per activation row: its per-group sums, computed once for every weight row */
    float *sums = (float *)malloc(sizeof(float) * (size_t)(M * (groups > 0 ? groups : 1)));
    act_row *acts = (act_row *)malloc(sizeof(act_row) * (size_t)(M > 0 ? M : 1));
    if (!sums || !acts) { free(sums); free(acts); return -2; }
    for (int64_t m = 0; m < M; m++)
        act_row_init(&acts[m], xq, dx, xs, pairs, pair_scales, m, K, per_group, groups, sums + m * groups);
    int64_t row_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    /* each thread one contiguous run of tasks of equal cost: a prefill chunk's experts take very
     * different numbers of rows, and equal numbers of tasks had left one thread most of the work */
    int64_t total_cost = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t rows = row_start[e + 1] - row_start[e];
        total_cost += rows ? (rows + 1) * row_blocks : 0;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t thread = 0, count = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        count = omp_get_num_threads();
#endif
        int64_t first = task_at_cost(row_start, E, row_blocks, total_cost * thread / count);
        int64_t last = task_at_cost(row_start, E, row_blocks, total_cost * (thread + 1) / count);
    for (int64_t task = first; task < last; task++) {
        int64_t e = task / row_blocks, n0 = (task % row_blocks) * ROW_BLOCK;
        int64_t n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
#ifdef COLIBRI_X86
        if (level >= 2 && row_start[e + 1] - row_start[e] > 1 && n1 - n0 == ROW_BLOCK && blocks % 2 == 0
            && PAIRED_GROUPS(per_group) && acts[0].pairs && zmm_ok()) {
            for (int64_t n = n0; n < n1; n += ZROWS) {
                float row_scales[ZROWS * groups + 16], coef_t[ZROWS * groups];
                zmm_row_scales(scales[e] + n * groups, zeros[e] ? zeros[e] + n * groups : 0, fp16, groups, row_scales,
                               coef_t);
                for (int64_t i = row_start[e]; i < row_start[e + 1]; i += ZACTS) {
                    int R = row_start[e + 1] - i < ZACTS ? (int)(row_start[e + 1] - i) : ZACTS;
                    const act_row *tile[ZACTS];
                    float *out[ZACTS];
                    for (int r = 0; r < R; r++) {
                        tile[r] = &acts[act_rows[i + r]];
                        out[r] = y + (i + r) * N + n;
                    }
                    weight_rows_zmm_acts(tiled_row(packed[e], n, layout), layout, row_scales, coef_t, blocks, per_group, tile,
                                         R, out);
                }
            }
            continue;
        }
        if (level >= 1 && row_start[e + 1] - row_start[e] > 1 && n1 - n0 == ROW_BLOCK && PAIRED_GROUPS(per_group)
            && acts[0].pairs) {
            block_rows(tiled_row(packed[e], n0, layout), layout, scales[e] + n0 * groups, zeros[e] ? zeros[e] + n0 * groups : 0,
                       fp16, blocks, per_group, acts, act_rows + row_start[e], row_start[e + 1] - row_start[e],
                       y + row_start[e] * N + n0, N, level);
            continue;
        }
#endif
        for (int64_t i = row_start[e]; i < row_start[e + 1]; i += TILE) {
            int R = row_start[e + 1] - i < TILE ? (int)(row_start[e + 1] - i) : TILE;
            const act_row *tile[TILE];
            for (int r = 0; r < R; r++) tile[r] = &acts[act_rows[i + r]];
            int64_t n = n0;
#ifdef COLIBRI_X86
            if (R == 1 && level >= 1 && tile[0]->pairs && PAIRED_GROUPS(per_group)) {
                const act_row *a = tile[0];
                if (level >= 2 && blocks % 2 == 0 && zmm_ok())
                    for (; n + ZROWS <= n1; n += ZROWS)
                        weight_rows_zmm(tiled_row(packed[e], n, layout), layout, scales[e] + n * groups,
                                        zeros[e] ? zeros[e] + n * groups : 0, fp16, blocks, per_group, a->pairs,
                                        a->pair_scales, a->offset, y + i * N + n);
                for (; n + WROWS <= n1; n += WROWS) {
                    const uint16_t *z = zeros[e] ? zeros[e] + n * groups : 0;
                    if (level >= 2)
                        weight_rows_vnni(tiled_row(packed[e], n, layout), layout, scales[e] + n * groups, z, fp16, blocks,
                                         per_group, a->pairs, a->pair_scales, a->offset, y + i * N + n);
                    else
                        weight_rows_avx2(tiled_row(packed[e], n, layout), layout, scales[e] + n * groups, z, fp16, blocks,
                                         per_group, a->pairs, a->pair_scales, a->offset, y + i * N + n);
                }
            }
#endif
            for (; n < n1; n++) {
                float *out[TILE];
                for (int r = 0; r < R; r++) out[r] = y + (i + r) * N + n;
                q4_tile(tile, R, tiled_row(packed[e], n, layout), row_chunk(layout), scales[e] + n * groups, zeros[e] ? zeros[e] + n * groups : 0,
                        fp16, blocks, per_group, out, level);
            }
        }
    }
    }
    free(sums);
    free(acts);
    return 0;
}

/* y [M, N] f32 = x [M, K] @ w[N, K].T, from colibri_q8_quantize's output. level: 0 scalar, 1 AVX2.
 * group: G (a multiple of 32 dividing K). zeros may be NULL. flags: bit 0 fp16 scales (else bf16),
 * ROW_TILES the matrix in row tiles. Returns 0, or -1 on bad shapes. The entry points below take
 * the same flags for their matrices. */
int colibri_q4_matmul(const int8_t *xq, const float *dx, const int32_t *xs, const int8_t *pairs,
                      const float *pair_scales, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *scales,
                      const uint16_t *zeros, int flags, int64_t N, int64_t G, float *y, int threads, int level) {
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
    if (!rows) return -2;
    for (int64_t m = 0; m < M; m++) rows[m] = m;
    int64_t start[2] = {0, M};
    int status = q4_products(xq, dx, xs, pairs, pair_scales, M, K, 1, &packed, &scales, &zeros, rows, start,
                             flags, N, G, y, threads, level);
    free(rows);
    return status;
}

/* ---- q6: 6-bit codes, the LM head's encoding of llama.cpp's size (colibri-int4 FORMAT.md) ----
 *
 *   data[n]  u8 [K * 3 / 4]: K/2 "lows" (each code's low 4 bits, in q4's nibble order), then K/4
 *            "highs" (its top 2 bits): per 64-column span s, highs[16 s + i] holds columns
 *            64s + 2i (bits 0-1), 64s + 2i + 1 (2-3), 64s + 32 + 2i (4-5), 64s + 33 + 2i (6-7)
 *   w[n, k] = (c[n, k] - 32) * scales[n, k/G], c in 0..63, symmetric
 *
 * Those are the columns of lanes i and 16 + i of the even and odd nibble vectors a 32-byte load of
 * lows splits into (SPLIT_NIBBLES), so the AVX2 path adds the top bits with two shifts and masks
 * and then runs q4's pair dot product unchanged: codes up to 63 times activations up to 127 keep
 * every int16 sum of vpmaddubsw (2 x 2 x 63 x 127 = 32004) below 2^15. The -32 is q4's -8 epilogue
 * times 4 (an exact factor), so a row costs q4's arithmetic plus the highs' 16 bytes a step. */

/* A q6 row's 128-column chunk is 64 bytes of low nibbles and 32 of top bits. Row-major (as
 * stored), a row holds all its lows then all its highs; in row tiles (the q4 / q8 layout's idea),
 * 4 rows at a time with their chunks interleaved, lows then highs: chunk c of row 4t + r at
 * 4t * row_bytes + c * 384 + r * 96. Needs K % 128 == 0 and N % 4 == 0. */
typedef struct {
    int64_t row_bytes, lows_step, highs_base, highs_step;
    int tiled;
} q6_layout;
static inline q6_layout q6_layout_of(int64_t K, int tiled) {
    q6_layout layout = {K / 4 * 3, tiled ? 384 : 64, tiled ? 64 : K / 2, tiled ? 384 : 32, tiled};
    return layout;
}
static inline const uint8_t *q6_row(const uint8_t *p, int64_t n, q6_layout layout) {
    return layout.tiled ? p + (n >> 2) * 4 * layout.row_bytes + (n & 3) * 96 : p + n * layout.row_bytes;
}
/* the 16 low bytes and 8 top-bit bytes of block b of a row */
#define Q6_LOWS_AT(row, b, layout) ((row) + ((b) >> 2) * (layout).lows_step + ((b) & 3) * 16)
#define Q6_HIGHS_AT(row, b, layout) ((row) + (layout).highs_base + ((b) >> 2) * (layout).highs_step + ((b) & 3) * 8)

int colibri_tile_q6_rows(const uint8_t *src, uint8_t *dst, int64_t N, int64_t K, int untile) {
    if (K % 128 || N % 4) return -1;
    q6_layout rowwise = q6_layout_of(K, 0), tiled = q6_layout_of(K, 1);
    int64_t tile_bytes = 4 * rowwise.row_bytes;
    uint8_t *copy = src == dst ? (uint8_t *)malloc((size_t)tile_bytes) : 0;
    if (src == dst && !copy) return -2;
    for (int64_t t = 0; t < N / 4; t++) {
        const uint8_t *from = src + t * tile_bytes;
        uint8_t *to = dst + t * tile_bytes;
        if (copy) {
            memcpy(copy, from, (size_t)tile_bytes);
            from = copy;
        }
        q6_layout in = untile ? tiled : rowwise, out = untile ? rowwise : tiled;
        for (int64_t r = 0; r < 4; r++) {
            const uint8_t *a = q6_row(from, r, in);
            uint8_t *b = (uint8_t *)q6_row(to, r, out);
            for (int64_t block = 0; block < K / BLOCK; block += 4) {
                memcpy((uint8_t *)Q6_LOWS_AT(b, block, out), Q6_LOWS_AT(a, block, in), 64);
                memcpy((uint8_t *)Q6_HIGHS_AT(b, block, out), Q6_HIGHS_AT(a, block, in), 32);
            }
        }
    }
    free(copy);
    return 0;
}

static inline int32_t q6_code(const uint8_t *row, q6_layout layout, int64_t k) {
    int64_t b = k / BLOCK, column = k % 64;
    int low = (Q6_LOWS_AT(row, b, layout)[(k % BLOCK) / 2] >> (4 * (k & 1))) & 15;
    /* a block pair's 16 top-bit bytes hold both blocks (columns c and c + 32 of a span of 64) */
    int top = (Q6_HIGHS_AT(row, b & ~1, layout)[(column % 32) / 2] >> (2 * (k & 1) + 4 * (column >= 32))) & 3;
    return low | top << 4;
}

static float row6_scalar(const uint8_t *row, q6_layout layout, int64_t K, const uint16_t *s, int fp16,
                         int64_t per_group, const int8_t *xq, const float *dx, const int32_t *xs) {
    float total = 0.f;
    for (int64_t g = 0; g * per_group * BLOCK < K; g++) {
        float acc = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            int32_t dot = 0;
            for (int64_t i = 0; i < BLOCK; i++) dot += q6_code(row, layout, b * BLOCK + i) * xq[b * BLOCK + i];
            acc += dx[b] * (float)(dot - 32 * xs[b]);
        }
        total += acc * half_to_f32(s[g], fp16);
    }
    return total;
}

#ifdef COLIBRI_X86
/* the top bits of a step's 64 columns (16 highs bytes) into its even and odd code vectors */
#define ADD_TOP_BITS(highs, even, odd)                                                                         \
    do {                                                                                                        \
        __m128i h_ = _mm_loadu_si128((const __m128i *)(highs));                                                 \
        __m256i both_ = _mm256_set_m128i(_mm_srli_epi16(h_, 4), h_);                                            \
        even = _mm256_or_si256(even, _mm256_slli_epi16(_mm256_and_si256(both_, three), 4));                     \
        odd = _mm256_or_si256(odd, _mm256_slli_epi16(_mm256_and_si256(both_, twelve), 2));                      \
    } while (0)

/* One activation row (pairs, as the q4 paths take it) times WR consecutive q6 weight rows, each
 * row the same sequence of operations whichever WR: q4's `weight_rows_*` with the top bits added.
 * The rows ahead are prefetched into L2, as there. Level 2 runs it too (the same bits). */
#define Q6_PREFETCH_ROWS 8
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q6_rows_body(
    const uint8_t *p, q6_layout layout, const uint16_t *s, int fp16, int64_t blocks, const int64_t per_group,
    const int8_t *pairs, const float *pair_scales, const float *offset, float *out, const int WR) {
    const __m256i low = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3), twelve = _mm256_set1_epi8(12);
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t groups = blocks / per_group, ahead = Q6_PREFETCH_ROWS * layout.row_bytes;
    const uint8_t *row[4];
    for (int r = 0; r < WR; r++) row[r] = q6_row(p, r, layout);
    float scales[4 * groups], coef[4 * groups];
    row_scales_avx2(s, WR * groups, fp16, scales); /* the rows' scales are consecutive */
    for (int64_t i = 0; i < WR * groups; i++) coef[i] = 4.f * scales[i]; /* the -32: q4's -8 epilogue x 4 */
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < WR; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) {
        __m256 ps0 = _mm256_loadu_ps(pair_scales + (b / 2) * 8), ps1 = _mm256_loadu_ps(pair_scales + (b / 2) * 8 + 8);
        const int64_t g0 = b / per_group, g1 = (b + 2) / per_group;
        for (int r = 0; r < WR; r++) {
            _mm_prefetch((const char *)Q6_LOWS_AT(row[r] + ahead, b, layout), _MM_HINT_T1);
            _mm_prefetch((const char *)Q6_HIGHS_AT(row[r] + ahead, b, layout), _MM_HINT_T1);
        }
        for (int r = 0; r < WR; r++) {
            const uint8_t *w = Q6_LOWS_AT(row[r], b, layout), *h = Q6_HIGHS_AT(row[r], b, layout);
            __m256i raw0 = _mm256_loadu_si256((const __m256i *)w);
            SPLIT_NIBBLES(raw0, even0, odd0);
            ADD_TOP_BITS(h, even0, odd0);
            __m256 d0 = _mm256_mul_ps(ps0, PAIR_SCALE(scales + r * groups, g0, per_group));
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_DOT_AVX2(even0, odd0,
                _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK)),
                _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 32)))), d0, acc0[r]);
            __m256i raw1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            SPLIT_NIBBLES(raw1, even1, odd1);
            ADD_TOP_BITS(h + 16, even1, odd1);
            __m256 d1 = _mm256_mul_ps(ps1, PAIR_SCALE(scales + r * groups, g1, per_group));
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_DOT_AVX2(even1, odd1,
                _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 64)),
                _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 96)))), d1, acc1[r]);
        }
    }
    if (b < blocks) { /* a last step of two blocks (b % 4 == 0: acc0's) */
        __m256 ps0 = _mm256_loadu_ps(pair_scales + (b / 2) * 8);
        for (int r = 0; r < WR; r++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)Q6_LOWS_AT(row[r], b, layout));
            SPLIT_NIBBLES(raw, even, odd);
            ADD_TOP_BITS(Q6_HIGHS_AT(row[r], b, layout), even, odd);
            __m256 d = _mm256_mul_ps(ps0, PAIR_SCALE(scales + r * groups, b / per_group, per_group));
            PAIR_STEP(PAIR_DOT_AVX2, even, odd, _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK)),
                      _mm256_loadu_si256((const __m256i *)(pairs + b * BLOCK + 32)), d, b, acc0[r], acc1[r]);
        }
    }
    float scalar[4] = {0.f, 0.f, 0.f, 0.f};
    if (WR == 4) epilogue_rows4(coef, groups, offset, scalar);
    else
        for (int64_t g = 0; g < groups; g++) scalar[0] -= coef[g] * offset[g];
    for (int r = 0; r < WR; r++) {
        __m256 both = _mm256_add_ps(acc0[r], acc1[r]);
        __m128 lo = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
        lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
        lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
        out[r] = _mm_cvtss_f32(lo) + scalar[r];
    }
}

__attribute__((target("avx2,fma,f16c"))) static void q6_rows_avx2(
    const uint8_t *p, q6_layout layout, const uint16_t *s, int fp16, int64_t blocks, int64_t per_group,
    const int8_t *pairs, const float *pair_scales, const float *offset, float *out, int WR) {
    if (WR == 4)
        WITH_PER_GROUP(per_group, q6_rows_body(p, layout, s, fp16, blocks, pg, pairs, pair_scales, offset, out, 4))
    else WITH_PER_GROUP(per_group, q6_rows_body(p, layout, s, fp16, blocks, pg, pairs, pair_scales, offset, out, 1))
}
#endif

/* y [M, N] f32 = x [M, K] @ w[N, K].T for a q6 matrix (data [N, K * 3 / 4], scales [N, K/G]), from
 * colibri_q8_quantize's output (K a multiple of 64, so its pairs are there). Blocks of 16 weight
 * rows in parallel; within a block, 4 weight rows at a time times each activation row in turn (the
 * rows stay in L1 between activation rows): a row's result never depends on M or the threads. */
int colibri_q6w_matmul(const int8_t *xq, const float *dx, const int32_t *xs, const int8_t *pairs,
                       const float *pair_scales, int64_t M, int64_t K, const uint8_t *data, const uint16_t *scales,
                       int flags, int64_t N, int64_t G, float *y, int threads, int level) {
    const q6_layout layout = q6_layout_of(K, (flags & ROW_TILES) != 0);
    const int fp16 = flags & 1;
    if (K % 64 || G % BLOCK || K % G || (layout.tiled && (K % 128 || N % 4))) return -1;
    int64_t blocks = K / BLOCK, per_group = G / BLOCK, groups = K / G;
#ifndef COLIBRI_X86
    level = 0;
#endif
    float *sums = (float *)malloc(sizeof(float) * (size_t)(M * groups > 0 ? M * groups : 1));
    act_row *acts = (act_row *)malloc(sizeof(act_row) * (size_t)(M > 0 ? M : 1));
    if (!sums || !acts) { free(sums); free(acts); return -2; }
    for (int64_t m = 0; m < M; m++)
        act_row_init(&acts[m], xq, dx, xs, pairs, pair_scales, m, K, per_group, groups, sums + m * groups);
    int vector = level >= 1 && pairs && PAIRED_GROUPS(per_group);
    int64_t row_blocks = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t task = 0; task < row_blocks; task++) {
        int64_t n0 = task * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n1;) {
            int WR = n + 4 <= n1 ? 4 : 1;
            for (int64_t m = 0; m < M; m++) {
                const act_row *a = &acts[m];
#ifdef COLIBRI_X86
                if (vector) {
                    q6_rows_avx2(q6_row(data, n, layout), layout, scales + n * groups, fp16, blocks, per_group, a->pairs,
                                 a->pair_scales, a->offset, y + m * N + n, WR);
                    continue;
                }
#endif
                for (int r = 0; r < WR; r++)
                    y[m * N + n + r] = row6_scalar(q6_row(data, n + r, layout), layout, K, scales + (n + r) * groups,
                                                   fp16, per_group, a->q, a->dx, a->xs);
            }
            n += WR;
        }
    }
    free(sums);
    free(acts);
    return 0;
}

/* E q4 matrices of one shape at once: matrix e times activation rows act_rows[row_start[e] ..
 * row_start[e + 1]), into rows row_start[e].. of y [row_start[E], N]. zeros: an array of E
 * pointers (NULL entries for symmetric matrices), or NULL. */
int colibri_q4_experts(const int8_t *xq, const float *dx, const int32_t *xs, const int8_t *pairs,
                       const float *pair_scales, int64_t M, int64_t K, int64_t E, const uint8_t *const *packed,
                       const uint16_t *const *scales, const uint16_t *const *zeros, const int64_t *act_rows,
                       const int64_t *row_start, int flags, int64_t N, int64_t G, float *y, int threads, int level) {
    for (int64_t i = 0; i < row_start[E]; i++)
        if (act_rows[i] < 0 || act_rows[i] >= M) return -1;
    const uint16_t *none[E > 0 ? E : 1];
    for (int64_t e = 0; e < E; e++) none[e] = 0;
    return q4_products(xq, dx, xs, pairs, pair_scales, M, K, E, packed, scales, zeros ? zeros : none, act_rows,
                       row_start, flags, N, G, y, threads, level);
}

/* One decode token's routed experts in two calls, around the activation the caller applies
 * (gate|up -> act -> down), with the bits of the calls they replace (colibri_q8_quantize, then
 * colibri_q4_experts; then colibri_add_weighted_rows): per layer two calls instead of six, and no
 * buffers to allocate on the caller's side.
 *
 * colibri_token_experts_in: x [K] quantized once, matrix e (of E, each [N, K]) times it -> y [E, N]. */
int colibri_token_experts_in(const float *x, int64_t K, int64_t E, const uint8_t *const *packed,
                             const uint16_t *const *scales, const uint16_t *const *zeros, int flags, int64_t N,
                             int64_t G, float *y, int threads, int level) {
    if (K % BLOCK || E < 1) return -1;
    int64_t blocks = K / BLOCK;
    int paired = K % (2 * BLOCK) == 0;
    int8_t *q = (int8_t *)malloc((size_t)(2 * K));
    float *words = (float *)malloc(sizeof(float) * (size_t)(6 * blocks));
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * E + 1));
    const uint16_t **none = (const uint16_t **)calloc((size_t)E, sizeof(*none));
    int status = -2;
    if (q && words && rows && none) {
        float *dx = words, *pair_scales = words + 2 * blocks;
        int32_t *xs = (int32_t *)(words + blocks);
        colibri_q8_quantize(x, 1, K, q, dx, xs, paired ? q + K : 0, paired ? pair_scales : 0, level);
        for (int64_t e = 0; e < E; e++) { rows[e] = 0; rows[E + e] = e; }
        rows[2 * E] = E;
        status = q4_products(q, dx, xs, paired ? q + K : 0, paired ? pair_scales : 0, 1, K, E, packed, scales,
                             zeros ? zeros : none, rows, rows + E, flags, N, G, y, threads, level);
    }
    free(q); free(words); free(rows); free(none);
    return status;
}

int colibri_add_weighted_rows(float *row, const float *rows, const float *weights, int64_t count, int64_t D);

/* colibri_token_experts_out: hidden [E, K] (each expert's activation), row e through matrix e ->
 * [E, N], then out [N] += row e * weights[e] for e = 0, 1, ... in that order. */
int colibri_token_experts_out(const float *hidden, int64_t K, int64_t E, const uint8_t *const *packed,
                              const uint16_t *const *scales, const uint16_t *const *zeros, int flags, int64_t N,
                              int64_t G, const float *weights, float *out, int threads, int level) {
    if (K % BLOCK || E < 1) return -1;
    int64_t blocks = K / BLOCK;
    int paired = K % (2 * BLOCK) == 0;
    int8_t *q = (int8_t *)malloc((size_t)(2 * E * K));
    float *words = (float *)malloc(sizeof(float) * (size_t)(6 * E * blocks));
    float *y = (float *)malloc(sizeof(float) * (size_t)(E * N));
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * E + 1));
    const uint16_t **none = (const uint16_t **)calloc((size_t)E, sizeof(*none));
    int status = -2;
    if (q && words && y && rows && none) {
        float *dx = words, *pair_scales = words + 2 * E * blocks;
        int32_t *xs = (int32_t *)(words + E * blocks);
        colibri_q8_quantize(hidden, E, K, q, dx, xs, paired ? q + E * K : 0, paired ? pair_scales : 0, level);
        for (int64_t e = 0; e < E; e++) { rows[e] = e; rows[E + e] = e; }
        rows[2 * E] = E;
        status = q4_products(q, dx, xs, paired ? q + E * K : 0, paired ? pair_scales : 0, E, K, E, packed, scales,
                             zeros ? zeros : none, rows, rows + E, flags, N, G, y, threads, level);
        if (status == 0) colibri_add_weighted_rows(out, y, weights, E, N);
    }
    free(q); free(words); free(y); free(rows); free(none);
    return status;
}

static inline float swiglu1(float g, float u) { return (g / (1.f + exp_f32(-g))) * u; }

#ifdef COLIBRI_X86
__attribute__((target("avx2"))) static void swiglu_avx2(const float *gate, const float *up, int64_t F, float *out) {
    const __m256 lo = _mm256_set1_ps(EXP_LO), hi = _mm256_set1_ps(EXP_HI), shifter = _mm256_set1_ps(EXP_SHIFTER);
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 x = _mm256_xor_ps(g, sign);                     /* -g */
        x = _mm256_max_ps(lo, x);                              /* lo > x ? lo : x, as the scalar */
        x = _mm256_min_ps(hi, x);                              /* hi < x ? hi : x */
        __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), shifter), shifter);
        __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI)));
        r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)));
        __m256 p = _mm256_set1_ps(EXP_POLY[0]);
        for (int k = 1; k < 6; k++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_POLY[k]));
        p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), one);
        __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
        __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        __m256 y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i));
        _mm256_storeu_ps(out + i, y);
    }
    for (; i < F; i++) out[i] = swiglu1(gate[i], up[i]);
}
#endif

/* hidden [M, F] = silu(gate) * up for gate_up [M, 2F] (each row gate | up, as a routed expert's
 * stacked projection gives it): gate / (1 + e^-gate) * up, each value alone, so a row's result never
 * depends on the rows beside it, on the level or on which path computed it. */
int colibri_swiglu_rows(const float *gate_up, int64_t M, int64_t F, float *hidden, int level) {
#ifndef COLIBRI_X86
    level = 0;
#endif
    for (int64_t m = 0; m < M; m++) {
        const float *gate = gate_up + m * 2 * F, *up = gate + F;
        float *out = hidden + m * F;
#ifdef COLIBRI_X86
        if (level >= 1) { swiglu_avx2(gate, up, F, out); continue; }
#endif
        for (int64_t i = 0; i < F; i++) out[i] = swiglu1(gate[i], up[i]);
    }
    return 0;
}

/* colibri_token_experts: a decode token's swiglu experts whole, out [K] += down_e(silu(gate_e x) *
 * up_e x) * weights[e] for e = 0, 1, ... in that order: colibri_token_experts_in, the activation
 * (colibri_swiglu_rows) and colibri_token_experts_out in one call. experts [E * 6]: expert e's
 * gate|up packed, scales, zeros (or 0) then its down packed, scales, zeros (or 0); gate|up is
 * [2F, K] in groups of G_gate_up, down [K, F] in groups of G_down. */
int colibri_token_experts(const float *x, int64_t K, int64_t E, const void *const *experts, int flags, int64_t F,
                          int64_t G_gate_up, int64_t G_down, const float *weights, float *out, int threads,
                          int level) {
    if (E < 1) return -1;
    const void **roles = (const void **)malloc(sizeof(void *) * (size_t)(6 * E));
    float *gate_up = (float *)malloc(sizeof(float) * (size_t)(2 * E * F));
    float *hidden = (float *)malloc(sizeof(float) * (size_t)(E * F));
    int status = -2;
    if (roles && gate_up && hidden) {
        for (int64_t e = 0; e < E; e++)  /* [role][expert], the pointer arrays the two calls take */
            for (int j = 0; j < 6; j++) roles[j * E + e] = experts[6 * e + j];
        const uint8_t *const *packed = (const uint8_t *const *)roles;
        const uint16_t *const *scales = (const uint16_t *const *)(roles + E);
        const uint16_t *const *zeros = (const uint16_t *const *)(roles + 2 * E);
        status = colibri_token_experts_in(x, K, E, packed, scales, zeros, flags, 2 * F, G_gate_up, gate_up, threads,
                                          level);
        if (status == 0) status = colibri_swiglu_rows(gate_up, E, F, hidden, level);
        if (status == 0)
            status = colibri_token_experts_out(hidden, F, E, (const uint8_t *const *)(roles + 3 * E),
                                               (const uint16_t *const *)(roles + 4 * E),
                                               (const uint16_t *const *)(roles + 5 * E), flags, K, G_down, weights,
                                               out, threads, level);
    }
    free(roles); free(gate_up); free(hidden);
    return status;
}

/* colibri_q8_token_experts: colibri_token_experts for experts stored as q8 (symmetric: each zeros
 * address 0): experts [E * 6] as there. There is no grouped q8 product: each expert's gate|up and
 * down run as colibri_q8w_matmul of one row (what a q8 expert's own products run), the activation
 * as colibri_swiglu_rows, and the sum as colibri_add_weighted_rows, so the same bits. */
int colibri_q8_token_experts(const float *x, int64_t K, int64_t E, const void *const *experts, int flags, int64_t F,
                             int64_t G_gate_up, int64_t G_down, const float *weights, float *out, int threads,
                             int level) {
    if (E < 1 || K % BLOCK || F % BLOCK) return -1;
    int64_t kb = K / BLOCK, fb = F / BLOCK;
    /* one quantized row each for x and a hidden row: values (and the pair order, unused here),
     * then scales and int sums (colibri_q8_quantize's outputs; no pair order or pair scales) */
    int8_t *xq = (int8_t *)malloc((size_t)(2 * K)), *hq = (int8_t *)malloc((size_t)(2 * F));
    float *xw = (float *)malloc(sizeof(float) * (size_t)(2 * kb)), *hw = (float *)malloc(sizeof(float) * (size_t)(2 * fb));
    float *gate_up = (float *)malloc(sizeof(float) * (size_t)(3 * F)), *y = (float *)malloc(sizeof(float) * (size_t)(E * K));
    int status = -2;
    if (xq && hq && xw && hw && gate_up && y) {
        float *hidden = gate_up + 2 * F;
        status = colibri_q8_quantize(x, 1, K, xq, xw, (int32_t *)(xw + kb), 0, 0, level);
        for (int64_t e = 0; e < E && status == 0; e++) {
            const void *const *a = experts + 6 * e;
            status = colibri_q8w_matmul(xq, xw, 1, K, (const int8_t *)a[0], (const uint16_t *)a[1], flags, 2 * F,
                                        G_gate_up, gate_up, threads, level);
            if (status == 0) status = colibri_swiglu_rows(gate_up, 1, F, hidden, level);
            if (status == 0)
                status = colibri_q8_quantize(hidden, 1, F, hq, hw, (int32_t *)(hw + fb), 0, 0, level);
            if (status == 0)
                status = colibri_q8w_matmul(hq, hw, 1, F, (const int8_t *)a[3], (const uint16_t *)a[4], flags, K,
                                            G_down, y + e * K, threads, level);
        }
        if (status == 0) status = colibri_add_weighted_rows(out, y, weights, E, K);
    }
    free(xq); free(hq); free(xw); free(hw); free(gate_up); free(y);
    return status;
}

/* y [M, N] f32 = x [M, K] f32 @ w[N, K].T for bf16 weights (u16 bits), a vocab projection kept as
 * stored: half the bytes of f32 weights, the same products (a bf16 is an f32 with a shorter
 * mantissa, so each product is exact). The sums run in f32 over two 8-lane accumulators per row
 * (columns k..k+7 and k+8..k+15 of every 16) in one fixed order, the same in the portable code
 * (fmaf per lane) as in AVX2, so every level gives the same bits and a row's result never depends
 * on the rows beside it. K must be a multiple of 16. */
static float rowbf_scalar(const uint16_t *w, const float *x, int64_t K) {
    float a[8] = {0}, b[8] = {0}, v[8], lo[4];
    for (int64_t k = 0; k < K; k += 16)
        for (int l = 0; l < 8; l++) {
            a[l] = fmaf(x[k + l], bf16_to_f32(w[k + l]), a[l]);
            b[l] = fmaf(x[k + 8 + l], bf16_to_f32(w[k + 8 + l]), b[l]);
        }
    for (int l = 0; l < 8; l++) v[l] = a[l] + b[l];
    for (int l = 0; l < 4; l++) lo[l] = v[l] + v[l + 4];  /* hsum256's order, lane for lane */
    return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

#ifdef COLIBRI_X86
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 bf16x8(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

/* R activation rows (1..4) times one bf16 weight row; each row runs the one-row sequence exactly */
#define ROWSBF(R)                                                                                               \
    do {                                                                                                        \
        __m256 a[4], b[4];                                                                                      \
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();                                          \
        for (int64_t k = 0; k < K; k += 16) {                                                                   \
            __m256 w0 = bf16x8(w + k), w1 = bf16x8(w + k + 8);                                                  \
            for (int r = 0; r < R; r++) {                                                                       \
                a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k), w0, a[r]);                                    \
                b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k + 8), w1, b[r]);                                \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < R; r++) *out[r] = hsum256(_mm256_add_ps(a[r], b[r]));                               \
    } while (0)

__attribute__((target("avx2,fma"))) static void tilebf_avx2(const uint16_t *w, int64_t K, int R,
                                                            const float *const *x, float *const *out) {
    switch (R) {
    case 4: ROWSBF(4); break;
    case 3: ROWSBF(3); break;
    case 2: ROWSBF(2); break;
    default: ROWSBF(1); break;
    }
}
#endif

int colibri_bf16w_matmul(const float *x, int64_t M, int64_t K, const uint16_t *weights, int64_t N, float *y,
                         int threads, int level) {
    if (K % 16) return -1;
#ifndef COLIBRI_X86
    level = 0;
#endif
    int64_t row_blocks = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t task = 0; task < row_blocks; task++) {
        int64_t n0 = task * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t m = 0; m < M; m += 4) {
            int R = M - m < 4 ? (int)(M - m) : 4;
            const float *rows[4];
            for (int r = 0; r < R; r++) rows[r] = x + (m + r) * K;
            for (int64_t n = n0; n < n1; n++) {
                float *out[4];
                for (int r = 0; r < R; r++) out[r] = y + (m + r) * N + n;
#ifdef COLIBRI_X86
                if (level >= 1) { tilebf_avx2(weights + n * K, K, R, rows, out); continue; }
#endif
                for (int r = 0; r < R; r++) *out[r] = rowbf_scalar(weights + n * K, rows[r], K);
            }
        }
    }
    return 0;
}

/* The fastest path this CPU runs: 2 AVX-512 VNNI (on 256-bit vectors), 1 AVX2, 0 portable C */
int colibri_q4_cpu_level(void) {
#ifdef COLIBRI_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni") ? 2 : 1;
#else
    return 0;
#endif
}

/* Rows [start, stop) of a q4 (packed, nibbles), q8 (int8) or q6 matrix (`kind`, below) as f32
 * [stop - start, K]: for products of many activation rows (prefill), where a dense matmul of the
 * dequantized rows beats one matrix-vector product per row. Plain loops: the compiler vectorises
 * them. */
enum { DEQUANTIZE_Q4 = 0, DEQUANTIZE_Q8 = 1, DEQUANTIZE_Q6 = 2 };
int colibri_dequantize_rows(const void *weights, int kind, const uint16_t *scales, const uint16_t *zeros, int flags,
                            int64_t K, int64_t G, int64_t start, int64_t stop, float *out) {
    const row_layout layout = {kind == DEQUANTIZE_Q8 ? K : K / 2, (flags & ROW_TILES) != 0};
    const int fp16 = flags & 1;
    /* tiles: whole 64-byte chunks (q4, q6: 128 columns; q8: 64) and whole tiles of rows */
    int64_t chunk_columns = kind == DEQUANTIZE_Q8 ? 64 : 128;
    if (K % G || (kind == DEQUANTIZE_Q6 && K % 64) || (layout.tiled && (K % chunk_columns || start % 4 || stop % 4)))
        return -1;
    const int64_t chunk = row_chunk(layout);
    int q8 = kind == DEQUANTIZE_Q8;
    int64_t groups = K / G;
    for (int64_t n = start; n < stop; n++) {
        float *row = out + (n - start) * K;
        for (int64_t g = 0; g < groups; g++) {
            float s = half_to_f32(scales[n * groups + g], fp16);
            float z = zeros ? half_to_f32(zeros[n * groups + g], fp16) : 0.f;
            float *dst = row + g * G;
            if (kind == DEQUANTIZE_Q6) {
                const q6_layout q6 = q6_layout_of(K, layout.tiled);
                const uint8_t *row = q6_row((const uint8_t *)weights, n, q6);
                for (int64_t i = 0; i < G; i++) dst[i] = (float)(q6_code(row, q6, g * G + i) - 32) * s;
            } else if (q8) {
                const int8_t *w = (const int8_t *)tiled_row((const uint8_t *)weights, n, layout);
                for (int64_t i = 0; i < G; i++) {
                    int64_t at = g * G + i;  /* the byte's place in the row; 64 a chunk */
                    dst[i] = (float)w[(at >> 6) * chunk + (at & 63)] * s;
                }
            } else {
                const uint8_t *p = tiled_row((const uint8_t *)weights, n, layout);
                for (int64_t j = 0; j < G / 2; j++) {
                    int64_t at = g * G / 2 + j;  /* the byte's place in the row; 64 a chunk */
                    uint8_t byte = p[(at >> 6) * chunk + (at & 63)];
                    dst[2 * j] = (float)((byte & 15) - 8) * s + z;
                    dst[2 * j + 1] = (float)((byte >> 4) - 8) * s + z;
                }
            }
        }
    }
    return 0;
}
