/* Decode attention on the CPU: one query token per session over that session's dense K/V rows.

   The query heads that share a KV head are that head's rows (GQA), so each key and value is read from
   memory once. Work is split over (session, KV head) units; each unit reads its keys, then its values, in
   tiles that stay in L1, with the scores of all its keys in a per-thread buffer between the two passes.
   The scores come straight from bfloat16 keys with AVX512-BF16's pair products where the CPU has them, and
   bfloat16 values are widened in registers, once for three (AVX2: two) rows of the group; other bfloat16
   inputs are widened to float32 a tile at a time. E4M3 keys and values (an FP8 cache: half the bytes of
   bfloat16) are widened a tile at a time, to bfloat16 for the pair-product paths under bfloat16 queries, else to
   float32; their head's key scale is folded into the scores' scale and its value scale into the output. Sums and
   the softmax are float32.

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

#define TILE 64             /* keys a tile: 16 KB of float32 rows at head_dim 64 */
#define MASKED (-1e30f)     /* a masked key's score: exp() of it less the row's max is exactly 0 */

/* Element types of the rows (the C kernels' dtype codes; E4M3 for keys and values only). */
enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_E4M3 = 2 };

/* `count` rows of `dim` values of element type `kind` from element `first` on, as float32: the rows themselves, or
   a copy in `scratch` */
static inline const float *rows_f32(const void *base, int kind, long first, int count, int dim, float *scratch) {
    long total = (long)count * dim;
    if (kind == KIND_F32) return (const float *)base + first;
    if (kind == KIND_E4M3) {
        e4m3_to_f32_rows((const uint8_t *)base + first, total, scratch);
        return scratch;
    }
    const uint16_t *p = (const uint16_t *)base + first;
    #pragma omp simd
    for (long e = 0; e < total; e++) scratch[e] = bf16_to_f32(p[e]);
    return scratch;
}

#if defined(__AVX512BF16__)
/* scores[i, j] = q[i] . k[j] straight from bfloat16 rows with AVX512-BF16's pair products (vdpbf16ps: each bf16
   product is exact in float32), eight keys at a time, in tiles of keys that stay in L1 across the group's rows;
   dim a multiple of 32. With `codes` (E4M3 keys, k unused) each tile is first widened into `tile` as bfloat16 of
   the keys times 2^-8. */
static void scores_bf16(int group, int dim, int width, const uint16_t *q, const uint16_t *k, const uint8_t *codes,
                        uint16_t *tile, float *scores) {
    for (int j0 = 0; j0 < width; j0 += TILE) {
        int end = width - j0 < TILE ? width : j0 + TILE;
        const uint16_t *kt = k + (long)j0 * dim;        /* key j0's row */
        if (codes) {
            e4m3_to_bf16_rows(codes + (long)j0 * dim, (long)(end - j0) * dim, tile);
            kt = tile;
        }
        for (int i = 0; i < group; i++) {
            const uint16_t *qi = q + (long)i * dim;
            float *si = scores + (size_t)i * width;
            int j = j0;
            for (; j + 8 <= end; j += 8) {
                vf a[8];
                for (int u = 0; u < 8; u++) a[u] = (vf){0};
                for (int e = 0; e < dim; e += 32) {
                    __m512bh qv = (__m512bh)_mm512_loadu_si512(qi + e);
                    for (int u = 0; u < 8; u++)
                        a[u] = (vf)_mm512_dpbf16_ps((__m512)a[u], qv,
                                                    (__m512bh)_mm512_loadu_si512(kt + (long)(j - j0 + u) * dim + e));
                }
                lane_sums8(a, si + j);
            }
            for (; j < end; j++) {
                __m512 a = _mm512_setzero_ps();
                for (int e = 0; e < dim; e += 32)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qi + e),
                                         (__m512bh)_mm512_loadu_si512(kt + (long)(j - j0) * dim + e));
                si[j] = _mm512_reduce_add_ps(a);
            }
        }
    }
}
#endif

/* scores[i, j] = q[i] . k[j] for the group's rows (at q_at) over `width` keys (at kv_at), eight keys at a time:
   eight independent chains of multiply-adds. Narrower rows are widened into qf and, a tile of keys at a time, tile. */
static void scores_f32(int group, int dim, int width, int q_kind, int kv_kind, const void *q, long q_at,
                       const void *k, long kv_at, float *qf, float *tile, float *scores) {
    for (int i = 0; i < group; i++) {
        const float *row = rows_f32(q, q_kind, q_at + (long)i * dim, 1, dim, qf + i * dim);
        if (row != qf + i * dim) memcpy(qf + i * dim, row, sizeof(float) * dim);
    }
    for (int j0 = 0; j0 < width; j0 += TILE) {
        int count = width - j0 < TILE ? width - j0 : TILE;
        const float *kt = rows_f32(k, kv_kind, kv_at + (long)j0 * dim, count, dim, tile);
        for (int i = 0; i < group; i++) {
            const float *qi = qf + i * dim;
            float *si = scores + (size_t)i * width + j0;
            int j = 0;
            for (; j + 8 <= count; j += 8) {
                vf a[8] = {0};
                for (int e = 0; e < dim; e += VL) {
                    vf qv = LOAD(qi + e);
                    for (int u = 0; u < 8; u++) a[u] += qv * LOAD(kt + (long)(j + u) * dim + e);
                }
                lane_sums8(a, si + j);
            }
            for (; j < count; j++) {
                vf a = {0};
                for (int e = 0; e < dim; e += VL) a += LOAD(qi + e) * LOAD(kt + (long)j * dim + e);
                si[j] = lane_sum(a);
            }
        }
    }
}

/* bfloat16 values widened in registers: a bf16 is the top half of its float32. */
typedef uint16_t vu16_unaligned __attribute__((vector_size(VL * 2), aligned(2), may_alias));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
static inline vf widen_bf16(const uint16_t *p) {
    return (vf)(__builtin_convertvector(*(const vu16_unaligned *)p, vu32) << 16);
}

/* Rows of the group whose four output vectors stay in registers together over a tile of bf16 values: 3 x 4
   accumulators fit AVX-512's 32 registers beside the widened values, 2 x 4 fit AVX2's 16. */
#define VALUE_ROWS (VL == 16 ? 3 : 2)

/* acc[r, e : e + 4 VL] += sum_j p[r, j] v[j, e : e + 4 VL] for `rows` (<= VALUE_ROWS) rows over `count` bf16 value
   rows: each value is widened once, in registers, for all the rows (widening a tile into memory first and
   reading it back per row made the value pass the slower half of the kernel). */
static inline __attribute__((always_inline)) void values_bf16(const int rows, int count, int dim, int e,
                                                              const float *p, long p_stride, const uint16_t *vt,
                                                              float *acc) {
    vf a[VALUE_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) a[r][c] = LOAD(acc + (long)r * dim + e + c * VL);
    for (int j = 0; j < count; j++) {
        const uint16_t *row = vt + (long)j * dim + e;
        vf w0 = widen_bf16(row), w1 = widen_bf16(row + VL), w2 = widen_bf16(row + 2 * VL), w3 = widen_bf16(row + 3 * VL);
        for (int r = 0; r < rows; r++) {
            float pr = p[r * p_stride + j];
            a[r][0] += pr * w0; a[r][1] += pr * w1; a[r][2] += pr * w2; a[r][3] += pr * w3;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) STORE(acc + (long)r * dim + e + c * VL, a[r][c]);
}

/* One (session, KV head): `group` query rows at q_at, keys and values at kv_at, `width` keys under `mask`; the
   output is scaled by `out_scale` (an E4M3 value scale, else 1). */
static void attend_unit(int group, int dim, int width, int bf16, int kv_kind, const void *q, long q_at,
                        const void *k, const void *v, long kv_at, const uint8_t *mask, void *out, float scale,
                        float out_scale, float *work) {
    float *scores = work, *qf = scores + (size_t)group * width, *acc = qf + (size_t)group * dim;
    float *tile = acc + (size_t)group * dim;
    /* bfloat16 queries over E4M3 pages take the bfloat16 paths, each tile widened to bfloat16 first (AVX512-BF16) */
    int e4m3_as_bf16 = 0;
#if defined(__AVX512BF16__)
    e4m3_as_bf16 = bf16 && kv_kind == KIND_E4M3 && dim % 32 == 0 && dim % (4 * VL) == 0;
    if (e4m3_as_bf16) {            /* the tiles hold the values times 2^-8 */
        scale *= 256.f;
        out_scale *= 256.f;
    }
    if (bf16 && (kv_kind == KIND_BF16 || e4m3_as_bf16) && dim % 32 == 0)
        scores_bf16(group, dim, width, (const uint16_t *)q + q_at, (const uint16_t *)k + kv_at,
                    e4m3_as_bf16 ? (const uint8_t *)k + kv_at : NULL, (uint16_t *)tile, scores);
    else
#endif
        scores_f32(group, dim, width, bf16 ? KIND_BF16 : KIND_F32, kv_kind, q, q_at, k, kv_at, qf, tile, scores);
    /* softmax of each row; masked keys get exactly 0 */
    for (int i = 0; i < group; i++) {
        float *si = scores + (size_t)i * width, top = MASKED, total = 0.f;
        #pragma omp simd reduction(max:top)
        for (int j = 0; j < width; j++) {
            float x = mask[j] ? si[j] * scale : MASKED;
            si[j] = x;
            top = x > top ? x : top;
        }
        if (top <= MASKED) {                  /* nothing allowed: weights 0, the result 0 */
            memset(si, 0, sizeof(float) * width);
            continue;
        }
        #pragma omp simd reduction(+:total)
        for (int j = 0; j < width; j++) { float p = exp_nonpositive(si[j] - top); si[j] = p; total += p; }
        float inv = 1.f / total;
        #pragma omp simd
        for (int j = 0; j < width; j++) si[j] *= inv;
    }
    /* outputs: the values weighted by the softmax */
    memset(acc, 0, sizeof(float) * group * dim);
    if ((kv_kind == KIND_BF16 || e4m3_as_bf16) && dim % (4 * VL) == 0) {
        const uint16_t *vb = (const uint16_t *)v + kv_at;
        for (int j0 = 0; j0 < width; j0 += TILE) {
            int count = width - j0 < TILE ? width - j0 : TILE;
            const uint16_t *vt = vb + (long)j0 * dim;
#if defined(__AVX512BF16__)
            if (e4m3_as_bf16) {
                e4m3_to_bf16_rows((const uint8_t *)v + kv_at + (long)j0 * dim, (long)count * dim, (uint16_t *)tile);
                vt = (const uint16_t *)tile;
            }
#endif
            for (int e = 0; e < dim; e += 4 * VL)
                for (int i = 0; i < group; i += VALUE_ROWS) {
                    const float *pi = scores + (size_t)i * width + j0;
                    /* each call with a constant row count, so that its sums stay in registers */
                    if (group - i >= VALUE_ROWS) values_bf16(VALUE_ROWS, count, dim, e, pi, width, vt, acc + i * dim);
                    else if (group - i == 2) values_bf16(2, count, dim, e, pi, width, vt, acc + i * dim);
                    else values_bf16(1, count, dim, e, pi, width, vt, acc + i * dim);
                }
        }
    } else {
        /* four vectors of a row at a time over a tile's keys, even and odd keys in separate sums */
        for (int j0 = 0; j0 < width; j0 += TILE) {
            int count = width - j0 < TILE ? width - j0 : TILE;
            const float *vt = rows_f32(v, kv_kind, kv_at + (long)j0 * dim, count, dim, tile);
            for (int i = 0; i < group; i++) {
                const float *pi = scores + (size_t)i * width + j0;
                float *ai = acc + i * dim;
                int e = 0;
                for (; e + 4 * VL <= dim; e += 4 * VL) {
                    vf a0 = LOAD(ai + e), a1 = LOAD(ai + e + VL), a2 = LOAD(ai + e + 2 * VL), a3 = LOAD(ai + e + 3 * VL);
                    vf b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
                    int j = 0;
                    for (; j + 2 <= count; j += 2) {
                        const float *v0 = vt + (long)j * dim + e, *v1 = v0 + dim;
                        float p0 = pi[j], p1 = pi[j + 1];
                        a0 += p0 * LOAD(v0); a1 += p0 * LOAD(v0 + VL); a2 += p0 * LOAD(v0 + 2 * VL); a3 += p0 * LOAD(v0 + 3 * VL);
                        b0 += p1 * LOAD(v1); b1 += p1 * LOAD(v1 + VL); b2 += p1 * LOAD(v1 + 2 * VL); b3 += p1 * LOAD(v1 + 3 * VL);
                    }
                    for (; j < count; j++) {
                        const float *v0 = vt + (long)j * dim + e;
                        float p0 = pi[j];
                        a0 += p0 * LOAD(v0); a1 += p0 * LOAD(v0 + VL); a2 += p0 * LOAD(v0 + 2 * VL); a3 += p0 * LOAD(v0 + 3 * VL);
                    }
                    STORE(ai + e, a0 + b0); STORE(ai + e + VL, a1 + b1);
                    STORE(ai + e + 2 * VL, a2 + b2); STORE(ai + e + 3 * VL, a3 + b3);
                }
                for (; e < dim; e += VL) {
                    vf a0 = LOAD(ai + e);
                    for (int j = 0; j < count; j++) a0 += pi[j] * LOAD(vt + (long)j * dim + e);
                    STORE(ai + e, a0);
                }
            }
        }
    }
    if (out_scale != 1.f) {
        #pragma omp simd
        for (long e = 0; e < (long)group * dim; e++) acc[e] *= out_scale;
    }
    for (int i = 0; i < group; i++) {
        long o = q_at + (long)i * dim;
        const float *ai = acc + i * dim;
        if (bf16) {
            uint16_t *po = (uint16_t *)out + o;
            for (int e = 0; e < dim; e++) po[e] = f32_to_bf16(ai[e]);
        } else {
            memcpy((float *)out + o, ai, sizeof(float) * dim);
        }
    }
}

/* out[r, h, i] = softmax over j < width where mask[r, j] of scale * q[r, h, i] . k[r, h, j], applied to v[r, h, j].
   q and out: contiguous [n, kv_heads, group, dim]; key/value j of (r, h) at r * row_stride + h * head_stride
   + j * dim (elements), its `dim` values contiguous; mask: [n, width] bytes, row r at r * mask_stride.
   q and out are float32 or bfloat16 (`bf16`); keys and values of `kv_kind` (KIND_*): q's type, or E4M3 with
   kv_scale [2, kv_heads] (key scales, then value scales: a stored code times its head's scale is the value).
   A row whose keys are all masked gets zeros. Returns 0, 1 when dim is not a multiple of the vector width,
   2 when the scratch memory could not be allocated, 3 for keys and values of another type than q's without scales. */
int metronome_decode_attention(int n, int kv_heads, int group, int dim, int width, int bf16, int kv_kind,
                               const void *q, const void *k, const void *v, long row_stride, long head_stride,
                               const uint8_t *mask, long mask_stride, const float *kv_scale, void *out, float scale,
                               int threads) {
    if (dim % VL) return 1;
    if (kv_kind == KIND_E4M3 ? !kv_scale : kv_kind != (bf16 ? KIND_BF16 : KIND_F32)) return 3;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *work = malloc(sizeof(float) * ((size_t)group * width + 2 * (size_t)group * dim + (size_t)TILE * dim));
        if (!work) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(static)
        for (long unit = 0; unit < (long)n * kv_heads; unit++) {
            int head = (int)(unit % kv_heads);
            int fp8 = kv_kind == KIND_E4M3;
            if (work)
                attend_unit(group, dim, width, bf16, kv_kind, q, unit * group * dim, k, v,
                            (unit / kv_heads) * row_stride + head * head_stride,
                            mask + (unit / kv_heads) * mask_stride, out, fp8 ? scale * kv_scale[head] : scale,
                            fp8 ? kv_scale[kv_heads + head] : 1.f, work);
        }
        free(work);
    }
    return failed;
}

/* out[u, :] = codes[u, :] (E4M3) x scale[u % heads] for u < units rows of `dim` contiguous codes (an E4M3 page's
   keys or values, [tokens, heads, dim]), as float32, or rounded once to bfloat16 (`bf16`): torch's
   (codes.float() * scale).to(dtype), whose conversion from float8 runs an element at a time. Returns 0, or 2 when
   scratch memory could not be allocated. */
int metronome_e4m3_dequantize(long units, int heads, int dim, const uint8_t *codes, const float *scale, void *out,
                              int bf16, int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (units * dim >= (1L << 18))
    {
        float *row = bf16 ? malloc(sizeof(float) * dim) : NULL;
        if (bf16 && !row) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(static)
        for (long u = 0; u < units; u++) {
            float s = scale[u % heads];
            if (!bf16) {
                float *dst = (float *)out + u * dim;
                e4m3_to_f32_rows(codes + u * dim, dim, dst);
                #pragma omp simd
                for (int e = 0; e < dim; e++) dst[e] *= s;
            } else if (row) {
                uint16_t *dst = (uint16_t *)out + u * dim;
                e4m3_to_f32_rows(codes + u * dim, dim, row);
                #pragma omp simd
                for (int e = 0; e < dim; e++) dst[e] = f32_to_bf16(row[e] * s);
            }
        }
        free(row);
    }
    return failed;
}

/* Floats in one vector of the CPU this was built for: head_dim must be a multiple of it. */
int metronome_vector_width(void) { return VL; }
