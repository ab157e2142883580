/* Greedy decoding's choice of a step's logits on a CPU (cpu_kernel.argmax): torch's argmax reads a
   row of the bundled target's 49,152 logits at ~4 GB/s on the 2-core EPYC (30-50 us a row, 85-140
   us for a verify step's 6-9 rows); this reads it ~4.5x faster. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

/* The index of x [V]'s largest value as torch.argmax gives it: the first of equal maxima, and the
   first NaN where there is one (NaN counts as the largest). 4 x 8 lanes keep each the first maximum
   it sees (four chains of compares, not one), then the largest of them at its lowest index. */
int64_t argmax_row(const float *x, long V) {
    v8 best[4];
    v8i at[4], nan = {0}, idx = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int c = 0; c < 4; c++) best[c] = (v8){0} - INFINITY, at[c] = (v8i){0};
    long i = 0;
    for (; i + 32 <= V; i += 32, idx += 32)
        for (int c = 0; c < 4; c++) {
            v8 v = load8(x + i + 8 * c);
            v8i more = v > best[c];
            best[c] = blend(more, v, best[c]);
            at[c] = (at[c] & ~more) | ((idx + 8 * c) & more);
            nan |= v != v;
        }
    int any = 0;
    for (int l = 0; l < 8; l++) any |= nan[l];
    for (long j = i; j < V; j++) any |= x[j] != x[j];
    if (any)
        for (long j = 0; j < V; j++)
            if (x[j] != x[j]) return j;
    float top = -INFINITY;
    int64_t where = 0;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 8; l++)
            if (best[c][l] > top || (best[c][l] == top && at[c][l] < where)) top = best[c][l], where = at[c][l];
    for (; i < V; i++)
        if (x[i] > top) top = x[i], where = i;
    return where;
}

/* out [M] = the argmax of each row of x [M, V] (rows `stride` floats apart), the rows split over the threads. */
void argmax_rows(const float *x, long M, long V, long stride, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (long m = 0; m < M; m++) out[m] = argmax_row(x + m * stride, V);
}
