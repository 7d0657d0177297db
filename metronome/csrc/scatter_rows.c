/* A decode round's new keys and values written into the paged cache and the decode window's buffers.

   Each is a few rows (one token per session) scattered to rows given by an index; torch's index_copy_ sets up
   an iterator over the whole destination for them; here each row is one memcpy.

   Built by metronome/native.py. */
#include <stdint.h>
#include <string.h>

/* dst row index[t * heads + h] = src row (t, h) at t * token_stride + h * head_stride, for t < tokens, h < heads;
   rows of row_bytes, strides in bytes. Returns 0, or 1 (nothing written) when an index is outside [0, dst_rows). */
int metronome_scatter_rows(int tokens, int heads, long row_bytes, const char *src, long token_stride,
                           long head_stride, char *dst, long dst_rows, const int64_t *index) {
    for (long i = 0; i < (long)tokens * heads; i++)
        if (index[i] < 0 || index[i] >= dst_rows) return 1;
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++)
            memcpy(dst + index[(long)t * heads + h] * row_bytes,
                   src + (long)t * token_stride + (long)h * head_stride, (size_t)row_bytes);
    return 0;
}
