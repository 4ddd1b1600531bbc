/* The index walk rows.c and digests.c share: units of rows, each unit an index space of up
 * to MAX_DIMS dims (outermost first) over rows at byte strides dstr / sstr from the unit's
 * destination and source addresses. */
#ifndef MMTIER_WALK_H
#define MMTIER_WALK_H
#include <stdint.h>

#define MAX_DIMS 8

typedef struct {
    int64_t idx[MAX_DIMS];
    int64_t doff, soff;             /* the current row's byte offsets from the unit's start */
} walk_t;

/* Rows in the index space: -1 where nd is out of range, 0 where a dim is empty. */
static inline int64_t walk_rows(int nd, const int64_t *shape) {
    if (nd < 0 || nd > MAX_DIMS) return -1;
    int64_t total = 1;
    for (int i = 0; i < nd; i++) {
        if (shape[i] <= 0) return 0;
        total *= shape[i];
    }
    return total;
}

static inline void walk_start(walk_t *w) {
    for (int i = 0; i < MAX_DIMS; i++) w->idx[i] = 0;
    w->doff = w->soff = 0;
}

/* On to the next row, innermost dim first. */
static inline void walk_next(walk_t *w, int nd, const int64_t *shape, const int64_t *dstr,
                             const int64_t *sstr) {
    for (int i = nd - 1; i >= 0; i--) {
        w->idx[i]++; w->doff += dstr[i]; w->soff += sstr[i];
        if (w->idx[i] < shape[i]) return;
        w->doff -= dstr[i] * shape[i]; w->soff -= sstr[i] * shape[i]; w->idx[i] = 0;
    }
}

/* 1 where every destination row starts on a multiple of `align` bytes (streaming stores). */
static inline int dst_aligned(const int64_t *dst, int64_t n_units, int nd, const int64_t *dstr,
                              int64_t row, int64_t align) {
    if (row % align != 0) return 0;
    for (int i = 0; i < nd; i++)
        if (dstr[i] % align != 0) return 0;
    for (int64_t u = 0; u < n_units; u++)
        if (dst[u] % align != 0) return 0;
    return 1;
}
#endif
