/* E4M3 codes widened to float32 or bfloat16, vectorised for the CPU this is built for (e4m3.h).

   Built by metronome/native.py with -O3 -march=native -fopenmp. */
#include "e4m3.h"
#include "scalars.h"

#include <string.h>

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

/* An E4M3 code's bits moved into a float16's (sign to bit 15, the rest shifted 7 up) are a float16 of the value
   times 2^-8, subnormals included (float16 keeps 2^-17 exactly), and the CPU widens float16 to float32 in one
   instruction; the NaN codes (0x7f, 0xff) become a float16 NaN. */
#if defined(__AVX512BW__)
static inline __m512i e4m3_as_f16(__m256i codes) {
    __m512i x = _mm512_cvtepu8_epi16(codes), t = _mm512_slli_epi16(x, 7);
    t = _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));     /* bit 14 (the sign) to 15 */
    __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7f));
    return _mm512_mask_mov_epi16(t, nan, _mm512_set1_epi16(0x7e00));
}
#elif defined(__AVX2__) && defined(__F16C__)
static inline __m256i e4m3_as_f16(__m128i codes) {
    __m256i x = _mm256_cvtepu8_epi16(codes), t = _mm256_slli_epi16(x, 7);
    t = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
    return _mm256_blendv_epi8(t, _mm256_set1_epi16(0x7e00), nan);
}
#endif

void e4m3_to_f32_rows(const uint8_t *p, long total, float *out) {
    long e = 0;
#if defined(__AVX512BW__)
    const __m512 up = _mm512_set1_ps(256.f);
    for (; e + 32 <= total; e += 32) {
        __m512i t = e4m3_as_f16(_mm256_loadu_si256((const __m256i *)(p + e)));
        _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(t)), up));
        _mm512_storeu_ps(out + e + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(t, 1)), up));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 up = _mm256_set1_ps(256.f);
    for (; e + 16 <= total; e += 16) {
        __m256i t = e4m3_as_f16(_mm_loadu_si128((const __m128i *)(p + e)));
        _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(t)), up));
        _mm256_storeu_ps(out + e + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(t, 1)), up));
    }
#endif
    for (; e < total; e++) out[e] = e4m3_to_f32(p[e]);
}

#if defined(__AVX512VBMI__)
/* Low and high bytes of the bfloat16 of each E4M3 code without its sign (0..127) times 2^-8, filled when the
   library loads: two 128-byte tables that vpermi2b looks 64 codes up in at once. */
static uint8_t E4M3_BF16_LO[128], E4M3_BF16_HI[128];
__attribute__((constructor)) static void fill_e4m3_bf16_tables(void) {
    for (int c = 0; c < 128; c++) {
        uint16_t b = f32_to_bf16(e4m3_to_f32((uint8_t)c) * 0x1p-8f);
        E4M3_BF16_LO[c] = (uint8_t)b;
        E4M3_BF16_HI[c] = (uint8_t)(b >> 8);
    }
}
#endif

/* By table lookups of 64 codes at a time where the CPU has VBMI, else through float16 as above. */
void e4m3_to_bf16_rows(const uint8_t *p, long total, uint16_t *out) {
    long e = 0;
#if defined(__AVX512VBMI__)
    const __m512i lo0 = _mm512_loadu_si512(E4M3_BF16_LO), lo1 = _mm512_loadu_si512(E4M3_BF16_LO + 64);
    const __m512i hi0 = _mm512_loadu_si512(E4M3_BF16_HI), hi1 = _mm512_loadu_si512(E4M3_BF16_HI + 64);
    /* qwords 0..7 of the codes to lanes (0, 4), (1, 5), (2, 6), (3, 7): the per-lane byte interleaves below then
       give codes 0..31 and 32..63 in order */
    const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    for (; e + 64 <= total; e += 64) {
        __m512i c = _mm512_permutexvar_epi64(order, _mm512_loadu_si512(p + e));
        __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);          /* index bit 6 picks the table, bit 7 unused */
        __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(hi0, c, hi1), _mm512_and_si512(c, sign));
        _mm512_storeu_si512(out + e, _mm512_unpacklo_epi8(lo, hi));
        _mm512_storeu_si512(out + e + 32, _mm512_unpackhi_epi8(lo, hi));
    }
#endif
#if defined(__AVX512BF16__)
    for (; e + 32 <= total; e += 32) {
        __m512i t = e4m3_as_f16(_mm256_loadu_si256((const __m256i *)(p + e)));
        __m512bh b = _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(t, 1)),
                                         _mm512_cvtph_ps(_mm512_castsi512_si256(t)));
        _mm512_storeu_si512(out + e, (__m512i)b);
    }
#endif
    for (; e < total; e++) out[e] = f32_to_bf16(e4m3_to_f32(p[e]) * 0x1p-8f);
}

/* float32 to E4M3, rounding to nearest even, as torch's cast does: NaN stays NaN (0x7f with the sign), values past
   448 are not expected (the caller clamps). A subnormal result (below 2^-6) is the value added to 2^14 as float32,
   whose rounding step there is the E4M3 subnormals' 2^-9; a normal one drops 20 mantissa bits rounding to even and
   rebiases the exponent (127 -> 7). */
static inline uint8_t e4m3_from_f32(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    bits &= 0x7fffffffu;
    if (bits > 0x7f800000u) return sign | 0x7fu;
    if (bits < (121u << 23)) {
        float magnitude, shifted;
        memcpy(&magnitude, &bits, sizeof magnitude);
        shifted = magnitude + 16384.f;
        uint32_t out;
        memcpy(&out, &shifted, sizeof out);
        return sign | (uint8_t)(out - 0x46800000u);       /* 16384.f's bits */
    }
    bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u);
    return sign | (uint8_t)(bits >> 20);
}

/* out[t, h, :] = E4M3 of x[t, h, :] / scale[h], clamped to +-448 first, for t < tokens, h < heads: what
   (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn) gives, byte for byte. x float32 or bfloat16 (`bf16`), row
   (t, h) at t * token_stride + h * head_stride elements, its `dim` values contiguous; out contiguous. */
int metronome_e4m3_quantize(long tokens, int heads, int dim, const void *x, long token_stride, long head_stride,
                            int bf16, const float *scale, uint8_t *out) {
    for (long t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++) {
            long at = t * token_stride + h * head_stride;
            uint8_t *dst = out + (t * heads + h) * dim;
            float s = scale[h];
            for (int e = 0; e < dim; e++) {
                float v = (bf16 ? bf16_to_f32(((const uint16_t *)x)[at + e]) : ((const float *)x)[at + e]) / s;
                v = v > 448.f ? 448.f : (v < -448.f ? -448.f : v);       /* NaN passes both */
                dst[e] = e4m3_from_f32(v);
            }
        }
    return 0;
}
