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

/* One row's routing, as colibri-model's Router computes it for one token: logits = W x (+ bias)
 * (W [E, D] f32), scores = sigmoid(logits) or softmax(logits), the k experts of the highest
 * score (+ expert_bias, the balancing bias, when given) in descending order (a tie: the lower
 * id first), their scores normalised to sum 1 in double precision when route_norm, times
 * route_scale. ids [k] int64, gates [k] f32, scores [E] f32. A row's result never depends on the
 * rows routed beside it (a decode step of several sessions routes each row alone). */
int colibri_route_row(const float *x, int64_t D, const float *weight, const float *bias, const float *expert_bias,
                      int64_t E, int64_t k, int softmax, int route_norm, float route_scale, float *scores,
                      int64_t *ids, float *gates) {
    if (D % 8 || k < 1 || k > E) return -1;
    for (int64_t e = 0; e < E; e++) {
        float logit = dot8(weight + e * D, x, D);
        scores[e] = bias ? logit + bias[e] : logit;
    }
    if (softmax) {
        float top = scores[0], total = 0.f;
        for (int64_t e = 1; e < E; e++) top = scores[e] > top ? scores[e] : top;
        for (int64_t e = 0; e < E; e++) { scores[e] = expf(scores[e] - top); total += scores[e]; }
        for (int64_t e = 0; e < E; e++) scores[e] = scores[e] / total;
    } else {
        for (int64_t e = 0; e < E; e++) scores[e] = 1.f / (1.f + expf(-scores[e]));
    }
    double total = 0.0;
    for (int64_t slot = 0; slot < k; slot++) {  /* k passes over E: k and E are small */
        int64_t best = -1;
        float best_choice = 0.f;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t s = 0; s < slot; s++) taken |= ids[s] == e;
            if (taken) continue;
            float choice = expert_bias ? scores[e] + expert_bias[e] : scores[e];
            if (best < 0 || choice > best_choice) { best = e; best_choice = choice; }
        }
        ids[slot] = best;
        total += (double)scores[best];
    }
    for (int64_t slot = 0; slot < k; slot++) {
        float chosen = scores[ids[slot]];
        if (route_norm) chosen = (float)((double)chosen / total);
        gates[slot] = chosen * route_scale;
    }
    return 0;
}
