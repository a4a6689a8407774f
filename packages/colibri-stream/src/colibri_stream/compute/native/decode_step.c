/* The small per-row pieces of one decode token, in f32, without the several torch calls and
 * allocations each that cost more than their arithmetic at this size: q and k of one attention
 * layer normed per head and rotated (colibri-model's RMSNorm and RotaryEmbedding).
 *
 * Plain loops in a fixed order at the baseline instruction set, no multiply-add contraction
 * (-ffp-contract=off) and no reassociation: the same bits on every CPU. The results equal torch's to float rounding, not bit for bit (the
 * sum of squares runs in another order); the Python side keeps torch's path beside this one and
 * tests the two against each other. */

#include <math.h>
#include <stdint.h>

/* A dot product in 8 lanes (D a multiple of 8): one vector multiply-add chain the compiler can
 * emit without reassociating a single sum, then the lanes added in a fixed order. */
static inline float dot8(const float *a, const float *b, int64_t D) {
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < D; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += a[i + l] * b[i + l];
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

/* x [heads, D] in place: x * rsqrt(mean(x^2) + eps) * weight per head (weight NULL: no norm),
 * then the rotation of the halves, out = x cos + rotate_half(x) sin, with cos/sin the [D] rows of
 * this position (rotate_half(x) = [-x[D/2:], x[:D/2]], colibri-model's RotaryEmbedding). */
int colibri_norm_rope(float *x, int64_t heads, int64_t D, const float *weight, float eps, const float *cos,
                      const float *sin) {
    if (D % 8 || D > 1024) return -1;
    int64_t half = D / 2;
    float normed[1024];
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * D;
        if (weight) {
            float squares = dot8(v, v, D);
            float inv = 1.f / sqrtf(squares / (float)D + eps);
            for (int64_t i = 0; i < D; i++) normed[i] = v[i] * inv * weight[i];
        } else {
            for (int64_t i = 0; i < D; i++) normed[i] = v[i];
        }
        for (int64_t i = 0; i < half; i++) {
            float a = normed[i], b = normed[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
    return 0;
}

/* out [D] = x * rsqrt(mean(x^2) + eps) * weight, one row (colibri-model's RMSNorm). */
int colibri_rms_norm(const float *x, int64_t D, const float *weight, float eps, float *out) {
    if (D % 8) return -1;
    float inv = 1.f / sqrtf(dot8(x, x, D) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = x[i] * inv * weight[i];
    return 0;
}

/* row [D] += rows[e] * weights[e] for e = 0, 1, ... in that order, each product rounded to f32
 * before its sum: bit for bit what `row += y * w` does in torch, one expert after another (the
 * order the batched path's index_add_ takes), in one call instead of two ops per expert
 * (compiled with -ffp-contract=off: no compiler fuses the two into one multiply-add). */
int colibri_add_weighted_rows(float *row, const float *rows, const float *weights, int64_t count, int64_t D) {
    for (int64_t e = 0; e < count; e++) {
        const float *y = rows + e * D;
        float w = weights[e];
        for (int64_t i = 0; i < D; i++) {
            float product = y[i] * w;
            row[i] = row[i] + product;
        }
    }
    return 0;
}
