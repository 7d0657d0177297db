/* The CPU's vector as GCC vector extensions: the compiler picks the width of the CPU it builds for. */
#ifndef METRONOME_VECTORS_H
#define METRONOME_VECTORS_H

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_unaligned __attribute__((vector_size(VL * 4), aligned(4), may_alias));
#define LOAD(p) (*(const vf_unaligned *)(p))
#define STORE(p, x) (*(vf_unaligned *)(p) = (x))

static inline float lane_sum(vf x) { float s = 0.f; for (int l = 0; l < VL; l++) s += x[l]; return s; }

#if VL >= 8
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
static inline vf8 to8(vf x) {
#if VL == 16
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return x;
#endif
}
/* pairwise sums within each 128-bit half: [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7] */
static inline vf8 pairs(vf8 x, vf8 y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}
/* out[u] = the sum of a[u]'s lanes for eight vectors, in a few shuffles instead of eight serial reductions */
static inline void lane_sums8(const vf *a, float *out) {
    vf8 lo = pairs(pairs(to8(a[0]), to8(a[1])), pairs(to8(a[2]), to8(a[3])));
    vf8 hi = pairs(pairs(to8(a[4]), to8(a[5])), pairs(to8(a[6]), to8(a[7])));
    *(vf8_unaligned *)out = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11)
                          + __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}
#else
static inline void lane_sums8(const vf *a, float *out) { for (int u = 0; u < 8; u++) out[u] = lane_sum(a[u]); }
#endif

#endif
