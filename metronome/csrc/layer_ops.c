/* The elementwise steps of a decoder layer on the CPU: RMSNorm, the rotary embedding, SiLU times the up half.

   In a decode round each works on a few rows, and torch runs it as several operators (RMSNorm as eight, the
   rotary embedding as nine for q and for k): their dispatch costs more than their arithmetic. Here each is one
   call. Arithmetic is float32; where the tensors are bfloat16 a value is rounded to bfloat16 wherever torch's
   operators would store it between two steps, so the results agree with torch's path to float32 rounding.

   Built by metronome/native.py with -O3 -march=native -fopenmp. */
#include <math.h>
#include <stdint.h>

#include "scalars.h"

#define PARALLEL_ELEMENTS 65536   /* below this a call runs on one thread: waking the others costs more */

static inline float load(const void *p, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store(void *p, int bf16, long i, float x) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x); else ((float *)p)[i] = x;
}
/* x as torch leaves it in a tensor of the dtype between two operators */
static inline float stored(int bf16, float x) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r < rows of dim values (rows at r * ldx, r * ldo) */
int metronome_rms_norm(int rows, int dim, int bf16, const void *x, long ldx, const void *weight, float eps,
                       void *out, long ldo, int threads) {
    #pragma omp parallel for num_threads(threads) if ((long)rows * dim >= PARALLEL_ELEMENTS) schedule(static)
    for (int r = 0; r < rows; r++) {
        long xi = (long)r * ldx, oi = (long)r * ldo;
        float squares = 0.f;
        #pragma omp simd reduction(+:squares)
        for (int e = 0; e < dim; e++) { float v = load(x, bf16, xi + e); squares += v * v; }
        float inv = 1.f / sqrtf(squares / dim + eps);
        #pragma omp simd
        for (int e = 0; e < dim; e++)
            store(out, bf16, oi + e, load(weight, bf16, e) * stored(bf16, load(x, bf16, xi + e) * inv));
    }
    return 0;
}

/* The rows x[t, h] (at t * ld_token + h * ld_head, dim values) for t < tokens, h < heads, rotated in place:
   x * cos[t] + rotate_half(x) * sin[t], where rotate_half(x) = (-x[dim/2:], x[:dim/2]); cos/sin [tokens, dim]
   float32. Returns 1 when dim is odd. */
int metronome_rope(int tokens, int heads, int dim, int bf16, void *x, long ld_token, long ld_head,
                   const float *cos, const float *sin, int threads) {
    if (dim % 2) return 1;
    int half = dim / 2;
    #pragma omp parallel for num_threads(threads) if ((long)tokens * heads * dim >= PARALLEL_ELEMENTS) schedule(static)
    for (int th = 0; th < tokens * heads; th++) {
        int t = th / heads, h = th % heads;
        long at = (long)t * ld_token + (long)h * ld_head;
        const float *c = cos + (long)t * dim, *s = sin + (long)t * dim;
        #pragma omp simd
        for (int e = 0; e < half; e++) {
            float lo = load(x, bf16, at + e), hi = load(x, bf16, at + half + e);
            store(x, bf16, at + e, lo * c[e] - hi * s[e]);
            store(x, bf16, at + half + e, hi * c[half + e] + lo * s[half + e]);
        }
    }
    return 0;
}

/* out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:2 dim], silu(g) = g / (1 + exp(-g)); rows at r * ld, r * ldo */
int metronome_silu_mul(int rows, int dim, int bf16, const void *gate_up, long ld, void *out, long ldo, int threads) {
    #pragma omp parallel for num_threads(threads) if ((long)rows * dim >= PARALLEL_ELEMENTS) schedule(static)
    for (int r = 0; r < rows; r++) {
        long gi = (long)r * ld, oi = (long)r * ldo;
        #pragma omp simd
        for (int e = 0; e < dim; e++) {
            float g = load(gate_up, bf16, gi + e), up = load(gate_up, bf16, gi + dim + e);
            float small = exp_nonpositive(-fabsf(g));          /* exp(-|g|): no overflow either side */
            float sigmoid = g >= 0.f ? 1.f / (1.f + small) : small / (1.f + small);
            store(out, bf16, oi + e, stored(bf16, g * sigmoid) * up);
        }
    }
    return 0;
}
