/* e^x in f32 from plain operations, for the gated activation and attention's softmax.
 *
 * Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n from the
 * exponent bits; about 1 ulp. No fused multiply-add (the kernels build with -ffp-contract=off) and
 * no library call, so a vector lane that runs this sequence gives the scalar's bits, and every CPU
 * level the same (libm's expf is one call a value; torch's own differs by instruction set). x is
 * clamped to [-87, 88], where e^x stays a normal f32. */
#ifndef COLIBRI_EXP_F32_H
#define COLIBRI_EXP_F32_H
#include <stdint.h>

#define EXP_LO -87.f
#define EXP_HI 88.f
#define EXP_SHIFTER 12582912.f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_f32(float x) {
    x = x < EXP_LO ? EXP_LO : x;
    x = x > EXP_HI ? EXP_HI : x;
    float n = (x * EXP_LOG2E + EXP_SHIFTER) - EXP_SHIFTER;
    float r = x - n * EXP_LN2_HI;
    r = r - n * EXP_LN2_LO;
    float p = EXP_POLY[0];  /* Horner's steps written out: a loop here kept callers' loops scalar */
    p = p * r + EXP_POLY[1];
    p = p * r + EXP_POLY[2];
    p = p * r + EXP_POLY[3];
    p = p * r + EXP_POLY[4];
    p = p * r + EXP_POLY[5];
    p = p * (r * r) + r + 1.f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#endif
