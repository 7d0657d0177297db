/* A linear layer of E4M3 weights on the CPU: y = x (codes x scale)^T (+ bias), x and y float32 or bfloat16.

   An FP8 weight is half the bytes of a bfloat16 one, and bytes are what a decode round's products wait for on
   cores that share little memory bandwidth. Each thread widens a panel of PANEL weight rows into a buffer that
   stays in L2: to bfloat16 of the values times 2^-8 (exact) where the CPU has AVX512-BF16 and the rows are
   bfloat16, multiplied by AVX512-BF16's pair products (each product exact in float32); else to float32, with
   bfloat16 rows widened once a call. Every block of MB input rows is then multiplied by NB weight rows at a time
   in MB x NB vector accumulators along the inputs, so each code is read from memory once a call; an output
   channel's scale (and the 2^8) is applied once to its sums.

   Built by metronome/native.py with -O3 -march=native -fopenmp. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "e4m3.h"
#include "scalars.h"
#include "vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define PANEL 32    /* weight rows a thread widens at a time: 96 KB of bfloat16 at 1,536 inputs */
#define NB 4        /* weight rows a block */
#if VL == 16
#define MB 4        /* input rows a block: 4 x 4 accumulators, 4 weight vectors and an input in 32 registers */
#else
#define MB 3        /* 3 x 4 accumulators and 4 weight vectors in AVX2's 16 registers */
#endif

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* y[m0 + a, n0 + b] = sums[a * NB + b] x mult[n0 + b] (+ bias[n0 + b]) for a < mm, b < nn */
static inline void store_block(const float *sums, int mm, int nn, long m0, int n0, const float *scale, float up,
                               const float *bias, int bf16, void *y, long ldy) {
    for (int a = 0; a < mm; a++)
        for (int b = 0; b < nn; b++) {
            float v = sums[a * NB + b] * (scale[n0 + b] * up) + (bias ? bias[n0 + b] : 0.f);
            long at = (m0 + a) * ldy + n0 + b;
            if (bf16) ((uint16_t *)y)[at] = f32_to_bf16(v);
            else ((float *)y)[at] = v;
        }
}

/* One panel of `rows` float32 weight rows (the widened values) times every input row. */
static void panel_f32(int M, int K, int rows, int n0, const float *x, long ldx, const float *tile,
                      const float *scale, const float *bias, int bf16, void *y, long ldy) {
    for (int m0 = 0; m0 < M; m0 += MB) {
        int mm = min_int(MB, M - m0);
        const float *xr[MB];
        for (int a = 0; a < MB; a++) xr[a] = x + (long)(m0 + (a < mm ? a : 0)) * ldx;   /* past M: row m0 again */
        for (int b0 = 0; b0 < rows; b0 += NB) {
            int nn = min_int(NB, rows - b0);
            const float *wr[NB];
            for (int b = 0; b < NB; b++) wr[b] = tile + (long)(b0 + (b < nn ? b : 0)) * K;
            vf acc[16];
            for (int u = 0; u < 16; u++) acc[u] = (vf){0};
            for (int k = 0; k < K; k += VL) {
                vf wv[NB];
                for (int b = 0; b < NB; b++) wv[b] = LOAD(wr[b] + k);
                for (int a = 0; a < MB; a++) {
                    vf xv = LOAD(xr[a] + k);
                    for (int b = 0; b < NB; b++) acc[a * NB + b] += xv * wv[b];
                }
            }
            float sums[16];
            lane_sums8(acc, sums);
            lane_sums8(acc + 8, sums + 8);
            store_block(sums, mm, nn, m0, n0 + b0, scale, 1.f, bias, bf16, y, ldy);
        }
    }
}

#if defined(__AVX512BF16__)
/* One panel of `rows` bfloat16 weight rows (the values times 2^-8) times every bfloat16 input row, 32 inputs a
   pair product. */
static void panel_bf16(int M, int K, int rows, int n0, const uint16_t *x, long ldx, const uint16_t *tile,
                       const float *scale, const float *bias, void *y, long ldy) {
    for (int m0 = 0; m0 < M; m0 += MB) {
        int mm = min_int(MB, M - m0);
        const uint16_t *xr[MB];
        for (int a = 0; a < MB; a++) xr[a] = x + (long)(m0 + (a < mm ? a : 0)) * ldx;
        for (int b0 = 0; b0 < rows; b0 += NB) {
            int nn = min_int(NB, rows - b0);
            const uint16_t *wr[NB];
            for (int b = 0; b < NB; b++) wr[b] = tile + (long)(b0 + (b < nn ? b : 0)) * K;
            vf acc[16];
            for (int u = 0; u < 16; u++) acc[u] = (vf){0};
            for (int k = 0; k < K; k += 32) {
                __m512bh wv[NB];
                for (int b = 0; b < NB; b++) wv[b] = (__m512bh)_mm512_loadu_si512(wr[b] + k);
                for (int a = 0; a < MB; a++) {
                    __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[a] + k);
                    for (int b = 0; b < NB; b++)
                        acc[a * NB + b] = (vf)_mm512_dpbf16_ps((__m512)acc[a * NB + b], xv, wv[b]);
                }
            }
            float sums[16];
            lane_sums8(acc, sums);
            lane_sums8(acc + 8, sums + 8);
            store_block(sums, mm, nn, m0, n0 + b0, scale, 256.f, bias, 1, y, ldy);
        }
    }
}
#endif

#if defined(__AVX512BF16__)
/* The pair layout (metronome_e4m3_linear_pairs): output channels in groups of 16, each group's codes stored
   [K / 2][16][2], so one vector of widened codes holds 16 channels' weights for 2 inputs and a pair product by
   the broadcast 2 inputs of a row adds to 16 outputs at once: no sums across lanes, and the scales, bias and
   rounding of 16 outputs in a few vector instructions. */
#define PAIR_VECTORS 2      /* groups of 16 channels a panel: 32 channels, 2 x 12 accumulators */
#define PAIR_MB 12          /* input rows a block */

/* Rows m0 .. m0 + mb of x times the panel's `nv` groups (tile: their widened codes), into y. mb is a constant
   where this is called, so the compiler keeps the mb x nv accumulators in registers. */
static inline __attribute__((always_inline)) void pairs_block(const int mb, int nv, int K, const uint16_t *x,
                                                              long ldx, const uint16_t *tile, const __m512 *mult,
                                                              const __m512 *add, uint16_t *y, long ldy) {
    __m512 acc[PAIR_MB][PAIR_VECTORS];
    for (int a = 0; a < mb; a++)
        for (int v = 0; v < PAIR_VECTORS; v++) acc[a][v] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + (long)p * 32);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + ((long)K / 2 + p) * 32 * (nv > 1));
        for (int a = 0; a < mb; a++) {
            int32_t pair;                          /* the row's 2 inputs, wherever the row starts */
            memcpy(&pair, x + a * ldx + 2 * p, sizeof pair);
            __m512bh xa = (__m512bh)_mm512_set1_epi32(pair);
            acc[a][0] = _mm512_dpbf16_ps(acc[a][0], xa, w0);
            acc[a][1] = _mm512_dpbf16_ps(acc[a][1], xa, w1);
        }
    }
    for (int a = 0; a < mb; a++)
        for (int v = 0; v < nv; v++) {
            __m512 out = _mm512_fmadd_ps(acc[a][v], mult[v], add[v]);
            _mm256_storeu_si256((__m256i *)(y + a * ldy + 16 * v), (__m256i)_mm512_cvtneps_pbh(out));
        }
}

/* y[m, n] = x[m, :] . (w[n, :] x scale[n]) + (bias ? bias[n] : 0) for m < M, n < N, bfloat16 rows (x's at m * ldx,
   y's at m * ldy), the codes in the pair layout (`packed`: N / 16 groups of [K / 2][16][2]); scale [N] and bias [N]
   float32. Returns 0, 1 where this CPU has no AVX512-BF16 or N is not a multiple of 16 or K of 2, 2 when scratch
   memory could not be allocated. */
int metronome_e4m3_linear_pairs(int M, int N, int K, const uint16_t *x, long ldx, const uint8_t *packed,
                                const float *scale, const float *bias, uint16_t *y, long ldy, int threads) {
    if (N % 16 || K % 2) return 1;
    if (M == 0 || N == 0) return 0;
    int groups = N / 16, panels = (groups + PAIR_VECTORS - 1) / PAIR_VECTORS, failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        uint16_t *tile = malloc(sizeof(uint16_t) * (size_t)PAIR_VECTORS * 16 * K);
        if (!tile) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(static)
        for (int panel = 0; panel < panels; panel++) {
            int g0 = panel * PAIR_VECTORS, nv = min_int(PAIR_VECTORS, groups - g0), n0 = 16 * g0;
            if (!tile) continue;
            e4m3_to_bf16_rows(packed + (long)n0 * K, (long)nv * 16 * K, tile);
            __m512 mult[PAIR_VECTORS], add[PAIR_VECTORS];
            for (int v = 0; v < PAIR_VECTORS; v++) {
                int at = n0 + 16 * (v < nv ? v : 0);
                mult[v] = _mm512_mul_ps(_mm512_loadu_ps(scale + at), _mm512_set1_ps(256.f));
                add[v] = bias ? _mm512_loadu_ps(bias + at) : _mm512_setzero_ps();
            }
            for (int m0 = 0; m0 < M; m0 += PAIR_MB) {
                const uint16_t *xr = x + (long)m0 * ldx;
                uint16_t *yr = y + (long)m0 * ldy + n0;
                switch (min_int(PAIR_MB, M - m0)) {
                    case 1: pairs_block(1, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 2: pairs_block(2, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 3: pairs_block(3, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 4: pairs_block(4, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 5: pairs_block(5, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 6: pairs_block(6, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 7: pairs_block(7, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 8: pairs_block(8, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 9: pairs_block(9, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 10: pairs_block(10, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    case 11: pairs_block(11, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                    default: pairs_block(12, nv, K, xr, ldx, tile, mult, add, yr, ldy); break;
                }
            }
        }
        free(tile);
    }
    return failed;
}
#else
int metronome_e4m3_linear_pairs(int M, int N, int K, const uint16_t *x, long ldx, const uint8_t *packed,
                                const float *scale, const float *bias, uint16_t *y, long ldy, int threads) {
    (void)M; (void)N; (void)K; (void)x; (void)ldx; (void)packed; (void)scale; (void)bias; (void)y; (void)ldy;
    (void)threads;
    return 1;
}
#endif

/* y[m, n] = x[m, :] . (w[n, :] x scale[n]) + (bias ? bias[n] : 0) for m < M, n < N: x's rows at m * ldx and y's at
   m * ldy, float32 or bfloat16 (`bf16`, both); w [N, K] E4M3 codes, contiguous; scale [N] and bias [N] float32.
   Returns 0, 1 when K is not a multiple of the vector width, 2 when scratch memory could not be allocated. */
int metronome_e4m3_linear(int M, int N, int K, int bf16, const void *x, long ldx, const uint8_t *w,
                          const float *scale, const float *bias, void *y, long ldy, int threads) {
    int pairs_bf16 = 0;
#if defined(__AVX512BF16__)
    pairs_bf16 = bf16 && K % 32 == 0;
#endif
    if (!pairs_bf16 && K % VL) return 1;
    if (M == 0 || N == 0) return 0;
    float *xf = NULL;             /* bfloat16 rows widened once, where the float32 products take them */
    if (bf16 && !pairs_bf16 && !(xf = malloc(sizeof(float) * (size_t)M * K))) return 2;
    int panels = (N + PANEL - 1) / PANEL, failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        if (xf) {
            #pragma omp for schedule(static)
            for (int m = 0; m < M; m++)
                for (int k = 0; k < K; k++) xf[(long)m * K + k] = bf16_to_f32(((const uint16_t *)x)[m * ldx + k]);
        }
        void *tile = malloc((pairs_bf16 ? sizeof(uint16_t) : sizeof(float)) * (size_t)PANEL * K);
        if (!tile) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(static)
        for (int panel = 0; panel < panels; panel++) {
            int n0 = panel * PANEL, rows = min_int(PANEL, N - n0);
            if (!tile) continue;
#if defined(__AVX512BF16__)
            if (pairs_bf16) {
                e4m3_to_bf16_rows(w + (long)n0 * K, (long)rows * K, tile);
                panel_bf16(M, K, rows, n0, x, ldx, tile, scale, bias, y, ldy);
                continue;
            }
#endif
            e4m3_to_f32_rows(w + (long)n0 * K, (long)rows * K, tile);
            panel_f32(M, K, rows, n0, xf ? xf : x, xf ? K : ldx, tile, scale, bias, bf16, y, ldy);
        }
        free(tile);
    }
    free(xf);
    return failed;
}

/* Whether metronome_e4m3_linear_pairs runs on this CPU (AVX512-BF16). */
int metronome_e4m3_pairs_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
