/* A linear layer's product for a few rows on the CPU: y = x W^T (+ b), float32.

   A decode round multiplies every weight by only a few rows (one per session). The CPU BLAS runs such
   products far below the core's arithmetic rate; here a block of NB weight rows stays in L1 while every
   block of MB input rows is multiplied by it, in MB x NB vector accumulators along the inputs, so each weight
   is read from memory once per call and the lanes are summed once per output. A single row (one session's
   decode round, the logits of one answer) takes its own loop: one output at a time with four accumulators
   along the inputs, so the weights stream in memory order with no work for rows that are not there.

   Built by metronome/native.py with -O3 -march=native -fopenmp. */
#include "vectors.h"

#define MB 3    /* input rows a block: 3 x 4 accumulators and 4 weight vectors in 16 of AVX2's registers, */
#define NB 4    /* each input vector loaded as an FMA operand */

static void one_row(int N, int K, const float *x, const float *w, const float *bias, float *y, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const float *wr = w + (long)n * K;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int k = 0;
        for (; k + 4 * VL <= K; k += 4 * VL) {
            a0 += LOAD(x + k) * LOAD(wr + k);
            a1 += LOAD(x + k + VL) * LOAD(wr + k + VL);
            a2 += LOAD(x + k + 2 * VL) * LOAD(wr + k + 2 * VL);
            a3 += LOAD(x + k + 3 * VL) * LOAD(wr + k + 3 * VL);
        }
        for (; k < K; k += VL) a0 += LOAD(x + k) * LOAD(wr + k);
        y[n] = lane_sum((a0 + a1) + (a2 + a3)) + (bias ? bias[n] : 0.f);
    }
}

/* y[m, n] = x[m, :] . w[n, :] + (bias ? bias[n] : 0) for m < M, n < N; x's rows at m * ldx, w [N, K]
   contiguous, y's rows at m * ldy. Returns 0, or 1 when K is not a multiple of the vector width. */
int metronome_skinny_linear(int M, int N, int K, const float *x, long ldx, const float *w, const float *bias,
                            float *y, long ldy, int threads) {
    if (K % VL) return 1;
    if (M == 1) {
        one_row(N, K, x, w, bias, y, threads);
        return 0;
    }
    int blocks = (N + NB - 1) / NB;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int block = 0; block < blocks; block++) {
        int n0 = block * NB, nn = N - n0 < NB ? N - n0 : NB;
        const float *wr[NB];
        for (int b = 0; b < NB; b++) wr[b] = w + (long)(n0 + (b < nn ? b : 0)) * K;   /* past N: row n0 again */
        for (int m0 = 0; m0 < M; m0 += MB) {
            int mm = M - m0 < MB ? M - m0 : MB;
            const float *xr[MB];
            for (int a = 0; a < MB; a++) xr[a] = x + (long)(m0 + (a < mm ? a : 0)) * ldx;
            vf acc[MB][NB];
            for (int a = 0; a < MB; a++)
                for (int b = 0; b < NB; b++) acc[a][b] = (vf){0};
            for (int k = 0; k < K; k += VL) {
                vf wv[NB];
                for (int b = 0; b < NB; b++) wv[b] = LOAD(wr[b] + k);
                for (int a = 0; a < MB; a++) {
                    vf xv = LOAD(xr[a] + k);
                    for (int b = 0; b < NB; b++) acc[a][b] += xv * wv[b];
                }
            }
            for (int a = 0; a < mm; a++)
                for (int b = 0; b < nn; b++)
                    y[(long)(m0 + a) * ldy + n0 + b] = lane_sum(acc[a][b]) + (bias ? bias[n0 + b] : 0.f);
        }
    }
    return 0;
}
