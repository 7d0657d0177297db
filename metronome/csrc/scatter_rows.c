/* A decode round's new keys and values written into the paged cache and the decode window's buffers, and the
   window's rows gathered out of the cache.

   Each is rows moved by an index; torch's index_copy_ sets up an iterator over the whole destination for them
   (and a gather through index_select and a transposed index_copy_ moves every row twice); here each row is one
   memcpy.

   Built by metronome/native.py. */
#include <stdint.h>
#include <string.h>

#define PARALLEL_BYTES (1L << 20)   /* below this a copy runs on one thread: waking the others costs more */

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

/* dst row dst_index[i] = src row src_index[i] for i < count, rows of row_bytes. Returns 0, or 1 (nothing written)
   when an index is outside [0, src_rows) or [0, dst_rows). */
int metronome_copy_rows(long count, long row_bytes, const char *src, long src_rows, const int64_t *src_index,
                        char *dst, long dst_rows, const int64_t *dst_index, int threads) {
    for (long i = 0; i < count; i++)
        if (src_index[i] < 0 || src_index[i] >= src_rows || dst_index[i] < 0 || dst_index[i] >= dst_rows) return 1;
    #pragma omp parallel for num_threads(threads) if (count * row_bytes >= PARALLEL_BYTES) schedule(static)
    for (long i = 0; i < count; i++)
        memcpy(dst + dst_index[i] * row_bytes, src + src_index[i] * row_bytes, (size_t)row_bytes);
    return 0;
}
