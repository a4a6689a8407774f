/* One query row's attention over a session's cached keys and values: the decode step of one
 * sequence, out = softmax(q K^T * scale) V per query head, with grouped-query heads (query head h
 * reads key/value head h / (heads / kv_heads), as torch's SDPA with enable_gqa).
 *
 * Why not torch's SDPA: at the short contexts of most decode steps its dispatch costs more than
 * the arithmetic (about 40 us a call at 72 cached columns, 16 heads of 64, where this takes a few).
 *
 * Plain loops in a fixed order (8-lane dot products added in a fixed order, sums over positions
 * one after another, no multiply-add contraction), compiled once for the baseline and once for
 * AVX2 (level >= 1, where the scores of 8 keys are also reduced at once: 1.3x at 64 to 1024
 * cached columns): the vector lanes run the scalar sequence, so both give the same bits, and
 * a row's result never depends on the rows or sessions beside it. It equals SDPA to float rounding
 * (another order of sums, this file's exp): tests/test_native_decode.py holds the two together. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include "exp_f32.h"

#if defined(__x86_64__) || defined(_M_X64)
#define COLIBRI_X86 1
#include "transpose8.h"
#endif

#define MAX_HEAD 1024

__attribute__((always_inline)) static inline float dot_lanes(const float *a, const float *b, int64_t D) {
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < D; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += a[i + l] * b[i + l];
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

/* scores[g * S + s] for the group's query heads and keys from `first` on */
__attribute__((always_inline)) static inline void group_scores(const float *qj, int64_t group, int64_t D,
                                                               const float *K, int64_t key_col_stride, int64_t first,
                                                               int64_t S, float scale, float *scores) {
    for (int64_t s = first; s < S; s++)  /* each cached key read once for the group's query heads */
        for (int64_t g = 0; g < group; g++)
            scores[g * S + s] = dot_lanes(qj + g * D, K + s * key_col_stride, D) * scale;
}

#ifdef COLIBRI_X86
/* `group_scores` 8 keys at a time: each key's 8 lanes in one vector (dot_lanes' adds in its order),
 * then the 8 keys' vectors transposed so that one tree of adds, dot_lanes' tree, reduces all 8 at
 * once: the same bits, without a lane reduction per key. Keys past the last 8: `group_scores`. */
__attribute__((target("avx2"))) static void group_scores_avx2(const float *qj, int64_t group, int64_t D,
                                                                const float *K, int64_t key_col_stride, int64_t S,
                                                                float scale, float *scores) {
    int64_t s = 0;
    for (; s + 8 <= S; s += 8)
        for (int64_t g = 0; g < group; g++) {
            const float *q = qj + g * D;
            __m256 a[8];
            for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + i);
                for (int k = 0; k < 8; k++)
                    a[k] = _mm256_add_ps(a[k], _mm256_mul_ps(qv, _mm256_loadu_ps(K + (s + k) * key_col_stride + i)));
            }
            __m256 t[8]; /* t[l]: lane l of keys 0..7 */
            transpose8_ps(a, t);
            __m256 dots = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t[0], t[4]), _mm256_add_ps(t[1], t[5])),
                                        _mm256_add_ps(_mm256_add_ps(t[2], t[6]), _mm256_add_ps(t[3], t[7])));
            _mm256_storeu_ps(scores + g * S + s, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
        }
    group_scores(qj, group, D, K, key_col_stride, s, S, scale, scores);
}
#endif

/* The heads of one key/value head j (`group` query heads from qj), into out; `vector_scores`: the
 * scores by group_scores_avx2 (the AVX2 build only). */
__attribute__((always_inline)) static inline void attend_group(
    const float *qj, int64_t group, int64_t D, const float *K, int64_t key_col_stride, const float *V,
    int64_t value_col_stride, int64_t S, float scale, float *scores, float *out, int vector_scores) {
#ifdef COLIBRI_X86
    if (vector_scores)
        group_scores_avx2(qj, group, D, K, key_col_stride, S, scale, scores);
    else
#endif
        group_scores(qj, group, D, K, key_col_stride, 0, S, scale, scores);
    (void)vector_scores;
    for (int64_t g = 0; g < group; g++) {
        float *p = scores + g * S;
        float top = p[0];
        for (int64_t s = 1; s < S; s++) top = p[s] > top ? p[s] : top;
        for (int64_t s = 0; s < S; s++) p[s] = exp_f32(p[s] - top);
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  /* the sum in 8 lanes, then a fixed order */
        int64_t s = 0;
        for (; s + 8 <= S; s += 8)
            for (int l = 0; l < 8; l++) lane[l] += p[s + l];
        for (; s < S; s++) lane[s % 8] += p[s];
        float total = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        float acc[MAX_HEAD];
        for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
        for (int64_t s = 0; s < S; s++) {
            const float *v = V + s * value_col_stride;
            float weight = p[s];
            for (int64_t d = 0; d < D; d++) acc[d] += weight * v[d];
        }
        float *o = out + g * D;
        for (int64_t d = 0; d < D; d++) o[d] = acc[d] / total;
    }
}

/* The query heads of key/value head j; the common head sizes compiled apart (a constant D keeps a
 * head's accumulators in registers), each running the same operations. */
__attribute__((always_inline)) static inline void attend_kv_head(
    int64_t j, const float *q, int64_t group, int64_t D, const float *keys, int64_t key_head_stride,
    int64_t key_col_stride, const float *values, int64_t value_head_stride, int64_t value_col_stride, int64_t S,
    float scale, float *scores, float *out, int vector_scores) {
    const float *qj = q + j * group * D, *K = keys + j * key_head_stride, *V = values + j * value_head_stride;
    float *o = out + j * group * D;
    switch (D) {
    case 64: attend_group(qj, group, 64, K, key_col_stride, V, value_col_stride, S, scale, scores, o, vector_scores); break;
    case 128: attend_group(qj, group, 128, K, key_col_stride, V, value_col_stride, S, scale, scores, o, vector_scores); break;
    default: attend_group(qj, group, D, K, key_col_stride, V, value_col_stride, S, scale, scores, o, vector_scores); break;
    }
}

static void attend_kv_head_base(int64_t j, const float *q, int64_t group, int64_t D, const float *keys,
                                int64_t key_head_stride, int64_t key_col_stride, const float *values,
                                int64_t value_head_stride, int64_t value_col_stride, int64_t S, float scale,
                                float *scores, float *out) {
    attend_kv_head(j, q, group, D, keys, key_head_stride, key_col_stride, values, value_head_stride,
                   value_col_stride, S, scale, scores, out, 0);
}

#ifdef COLIBRI_X86
__attribute__((target("avx2"))) static void attend_kv_head_avx2(
    int64_t j, const float *q, int64_t group, int64_t D, const float *keys, int64_t key_head_stride,
    int64_t key_col_stride, const float *values, int64_t value_head_stride, int64_t value_col_stride, int64_t S,
    float scale, float *scores, float *out) {
    attend_kv_head(j, q, group, D, keys, key_head_stride, key_col_stride, values, value_head_stride,
                   value_col_stride, S, scale, scores, out, 1);
}
#endif

/* q [heads, D] f32; keys / values: position s of kv head j at base + j * head_stride + s *
 * col_stride (D consecutive floats: a [1, kv_heads, capacity, D] cache read through its first S
 * columns); out [heads, D]. D a multiple of 8 up to MAX_HEAD, heads a multiple of kv_heads, S >= 1.
 * level: 0 the baseline build, >= 1 the AVX2 one (the same bits). The key/value heads are shared
 * out among `threads` (each head's result computed whole by one thread: the same bits at any
 * count; at long contexts a decode layer's attention is otherwise the longest serial part).
 * Returns 0, -1 on bad shapes, -2 when out of memory. */
int colibri_attend_row(const float *q, int64_t heads, int64_t kv_heads, int64_t D, const float *keys,
                       int64_t key_head_stride, int64_t key_col_stride, const float *values,
                       int64_t value_head_stride, int64_t value_col_stride, int64_t S, float scale, float *out,
                       int level, int threads) {
    if (D % 8 || D < 8 || D > MAX_HEAD || kv_heads < 1 || heads % kv_heads || S < 1) return -1;
    int64_t group = heads / kv_heads;
    int shared_out = threads > 1 && kv_heads > 1;
    /* one group's score rows per thread */
    float *scores = (float *)malloc(sizeof(float) * (size_t)((shared_out ? threads : 1) * group * S));
    if (!scores) return -2;
#ifndef COLIBRI_X86
    level = 0;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (shared_out)
    for (int64_t j = 0; j < kv_heads; j++) {
        float *own = scores + (int64_t)omp_get_thread_num() * group * S;
#ifdef COLIBRI_X86
        if (level >= 1) {
            attend_kv_head_avx2(j, q, group, D, keys, key_head_stride, key_col_stride, values, value_head_stride,
                                value_col_stride, S, scale, own, out);
            continue;
        }
#endif
        attend_kv_head_base(j, q, group, D, keys, key_head_stride, key_col_stride, values, value_head_stride,
                            value_col_stride, S, scale, own, out);
    }
    free(scores);
    return 0;
}
