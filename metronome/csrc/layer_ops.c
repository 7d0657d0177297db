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

/* A step's loops are written once as a macro of the element type and its conversions to and from float32, and
   expanded once per dtype: with the dtype tested per element inside one loop, the compiler kept the float32 loops
   scalar, about three times slower. Each expansion is its own parallel loop, on one thread below
   PARALLEL_ELEMENTS. */
static inline float same(float x) { return x; }
static inline float bf16_rounded(float x) { return bf16_to_f32(f32_to_bf16(x)); }   /* as torch stores it */
#define FOR_DTYPE(bf16, LOOPS)                                        \
    do {                                                              \
        if (bf16) { LOOPS(uint16_t, bf16_to_f32, f32_to_bf16, bf16_rounded); } \
        else { LOOPS(float, same, same, same); }                      \
    } while (0)

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r < rows of dim values (rows at r * ldx, r * ldo) */
#define RMS_NORM_ROWS(T, load, store, stored)                                                                \
    _Pragma("omp parallel for num_threads(threads) if ((long)rows * dim >= PARALLEL_ELEMENTS) schedule(static)") \
    for (int r = 0; r < rows; r++) {                                                                         \
        const T *xr = (const T *)x + (long)r * ldx, *w = weight;                                            \
        T *o = (T *)out + (long)r * ldo;                                                                     \
        float squares = 0.f;                                                                                 \
        _Pragma("omp simd reduction(+:squares)")                                                             \
        for (int e = 0; e < dim; e++) { float v = load(xr[e]); squares += v * v; }                           \
        float inv = 1.f / sqrtf(squares / dim + eps);                                                        \
        _Pragma("omp simd")                                                                                  \
        for (int e = 0; e < dim; e++) o[e] = store(load(w[e]) * stored(load(xr[e]) * inv));                  \
    }
int metronome_rms_norm(int rows, int dim, int bf16, const void *x, long ldx, const void *weight, float eps,
                       void *out, long ldo, int threads) {
    FOR_DTYPE(bf16, RMS_NORM_ROWS);
    return 0;
}

/* The rows x[t, h] (at t * ld_token + h * ld_head, dim values) for t < tokens, h < heads, rotated in place:
   x * cos[t] + rotate_half(x) * sin[t], where rotate_half(x) = (-x[dim/2:], x[:dim/2]); cos/sin [tokens, dim]
   float32. Returns 1 when dim is odd. */
#define ROPE_ROWS(T, load, store, stored)                                                                    \
    _Pragma("omp parallel for num_threads(threads) if ((long)units * dim >= PARALLEL_ELEMENTS) schedule(static)") \
    for (int th = 0; th < units; th++) {                                                                     \
        int t = th / heads, h = th % heads;                                                                  \
        T *xr = (T *)x + (long)t * ld_token + (long)h * ld_head;                                            \
        const float *c = cos + (long)t * dim, *s = sin + (long)t * dim;                                      \
        _Pragma("omp simd")                                                                                  \
        for (int e = 0; e < half; e++) {                                                                     \
            float lo = load(xr[e]), hi = load(xr[half + e]);                                                 \
            xr[e] = store(lo * c[e] - hi * s[e]);                                                            \
            xr[half + e] = store(hi * c[half + e] + lo * s[half + e]);                                       \
        }                                                                                                    \
    }
int metronome_rope(int tokens, int heads, int dim, int bf16, void *x, long ld_token, long ld_head,
                   const float *cos, const float *sin, int threads) {
    if (dim % 2) return 1;
    int half = dim / 2, units = tokens * heads;   /* one (token, head) row each */
    FOR_DTYPE(bf16, ROPE_ROWS);
    return 0;
}

/* out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:2 dim], silu(g) = g / (1 + exp(-g)); rows at r * ld, r * ldo */
#define SILU_MUL_ROWS(T, load, store, stored)                                                                \
    _Pragma("omp parallel for num_threads(threads) if ((long)rows * dim >= PARALLEL_ELEMENTS) schedule(static)") \
    for (int r = 0; r < rows; r++) {                                                                         \
        const T *gr = (const T *)gate_up + (long)r * ld;                                                     \
        T *o = (T *)out + (long)r * ldo;                                                                     \
        _Pragma("omp simd")                                                                                  \
        for (int e = 0; e < dim; e++) {                                                                      \
            float g = load(gr[e]), up = load(gr[dim + e]);                                                   \
            float small = exp_nonpositive(-fabsf(g));          /* exp(-|g|): no overflow either side */      \
            float sigmoid = g >= 0.f ? 1.f / (1.f + small) : small / (1.f + small);                          \
            o[e] = store(stored(g * sigmoid) * up);                                                          \
        }                                                                                                    \
    }
int metronome_silu_mul(int rows, int dim, int bf16, const void *gate_up, long ld, void *out, long ldo, int threads) {
    FOR_DTYPE(bf16, SILU_MUL_ROWS);
    return 0;
}
