/* E4M3 (float8_e4m3fn) codes widened a run at a time, for the kernels that read FP8 pages or weights. */
#ifndef METRONOME_E4M3_H
#define METRONOME_E4M3_H

#include <stdint.h>

/* out[e] = the value of code p[e] as float32, for e < total; the NaN codes (0x7f, 0xff) give NaN. */
__attribute__((visibility("hidden"))) void e4m3_to_f32_rows(const uint8_t *p, long total, float *out);

/* out[e] = the bfloat16 of the value of code p[e] times 2^-8, for e < total: exact (E4M3 has 3 mantissa bits and
   bfloat16 7; the factor keeps the subnormals normal), so a product of such tiles is scaled by 2^8 once after. */
__attribute__((visibility("hidden"))) void e4m3_to_bf16_rows(const uint8_t *p, long total, uint16_t *out);

#endif
