/* Scalar functions the kernels share: bfloat16 conversions and an exp the compiler vectorises. */
#ifndef METRONOME_SCALARS_H
#define METRONOME_SCALARS_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) { union { uint32_t u; float f; } b = { .u = (uint32_t)x << 16 }; return b.f; }
static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, NaN kept a NaN */
    union { float f; uint32_t u; } b = { .f = f };
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40);
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

/* An E4M3 (float8_e4m3fn) code as float32: normal codes rebias the exponent (7 -> 127), subnormal ones are
   m * 2^-9, 0x7f / 0xff are NaN (a NaN key or value reaches the output, as with bfloat16 pages). */
static inline float e4m3_to_f32(uint8_t x) {
    uint32_t em = x & 0x7fu, sign = (uint32_t)(x & 0x80u) << 24;
    union { uint32_t u; float f; } normal = { .u = sign | ((em << 20) + (120u << 23)) };
    union { float f; uint32_t u; } small = { .f = (float)em * 0x1p-9f };
    small.u |= sign;
    if (em == 0x7fu) normal.u = 0x7fc00000u | sign;
    return em >= 8 ? normal.f : small.f;
}

/* exp(x) for x <= 0 as a polynomial the compiler vectorises (libm's expf is a call per element); 0 below -87,
   NaN for NaN (a NaN spreads to the output, as in torch's operators, rather than weighing 0) */
static inline float exp_nonpositive(float x) {
    float c = x > -87.f ? x : -87.f;
    float n = __builtin_floorf(c * 1.44269504f + 0.5f);
    float f = c - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.f + f * (1.f + f * (0.5f + f * (0.16666667f + f * (0.041666668f + f * (0.008333334f + f * 0.0013888889f)))));
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return x > -87.f ? p * two_n.f : (x != x ? x : 0.f);
}

#endif
