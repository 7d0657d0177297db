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

#endif
