/* The multiple-choice knapsack of cgx.policy.levels.solver, compiled.
 *
 * One candidate per layer; minimize the summed cost with the summed integer
 * error units at most `capacity`. dp_l[e] holds the least cost of layers 0..l
 * with exactly e units. The inner loop is a branch-free minimum (vectorized);
 * every row is kept, and backtracking finds the candidate whose sum reproduces
 * the stored minimum bit for bit (the same additions in the same order, so the
 * comparison is exact, not a tolerance). Candidates that
 * another one of the same layer beats on both cost and units are skipped, and
 * each row stops at the largest error index reachable so far. Ties go to the
 * lower candidate index and the lowest final error index: the same answer on
 * every rank and every run.
 *
 * The numpy version in solver.py (used when this library is not built) makes
 * the same choices up to ties between equal costs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "quant.h" /* the library's exported prototypes */

static int dominated(const double *c, const int64_t *u, int64_t n, int64_t j) {
    for (int64_t i = 0; i < n; i++) {
        if (i == j) continue;
        if (c[i] <= c[j] && u[i] <= u[j] && (c[i] < c[j] || u[i] < u[j] || i < j)) return 1;
    }
    return 0;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CGX_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CGX_CLONES
#endif

/* row[e] = min(row[e], prev[e - uj] + cj) for e in [uj, last] */
CGX_CLONES static void relax(double *restrict row, const double *restrict prev, int64_t uj,
                             int64_t last, double cj) {
    for (int64_t e = uj; e <= last; e++) {
        const double v = prev[e - uj] + cj;
        row[e] = v < row[e] ? v : row[e];
    }
}

int cgx_knapsack(int64_t layers, const int64_t *offsets, const double *costs,
                 const int64_t *units, int64_t capacity, int32_t *choice) {
    if (layers <= 0) return 0;
    if (capacity < 0) return 1;
    const int64_t n = capacity + 1;
    /* rows[0] is the empty prefix; rows[l + 1] holds dp after layer l */
    double *rows = malloc(sizeof(double) * n * (layers + 1));
    int64_t *reach = malloc(sizeof(int64_t) * (layers + 1));
    if (!rows || !reach) {
        free(rows); free(reach);
        return -1;
    }
    for (int64_t e = 0; e < n; e++) rows[e] = INFINITY;
    rows[0] = 0.0;
    reach[0] = 0;  /* rows[l][e] is infinite beyond reach[l] */
    int status = 0;
    for (int64_t l = 0; l < layers && status == 0; l++) {
        const int64_t k = offsets[l + 1] - offsets[l];
        const double *c = costs + offsets[l];
        const int64_t *u = units + offsets[l];
        const double *prev = rows + l * n;
        double *row = rows + (l + 1) * n;
        int64_t top = -1;
        for (int64_t e = 0; e < n; e++) row[e] = INFINITY;
        for (int64_t j = 0; j < k; j++) {
            if (u[j] < 0 || u[j] > capacity || !(c[j] < INFINITY) || dominated(c, u, k, j))
                continue;
            const int64_t last = reach[l] + u[j] < capacity ? reach[l] + u[j] : capacity;
            relax(row, prev, u[j], last, c[j]);
            if (last > top) top = last;
        }
        reach[l + 1] = top;
        int any = 0;
        for (int64_t e = 0; e <= top; e++) if (row[e] < INFINITY) { any = 1; break; }
        if (!any) status = 1;
    }
    if (status == 0) {
        const double *last_row = rows + layers * n;
        int64_t end = -1;
        for (int64_t e = 0; e <= reach[layers]; e++)
            if (last_row[e] < INFINITY && (end < 0 || last_row[e] < last_row[end])) end = e;
        for (int64_t l = layers - 1; l >= 0 && status == 0; l--) {
            const int64_t k = offsets[l + 1] - offsets[l];
            const double *c = costs + offsets[l];
            const int64_t *u = units + offsets[l];
            const double *prev = rows + l * n;
            const double want = rows[(l + 1) * n + end];
            int32_t found = -1;
            for (int64_t j = 0; j < k && found < 0; j++) {
                if (u[j] < 0 || u[j] > end || dominated(c, u, k, j)) continue;
                if (prev[end - u[j]] + c[j] == want) found = (int32_t)j;
            }
            if (found < 0) { status = -2; break; }  /* cannot happen: same sums as above */
            choice[l] = found;
            end -= u[found];
        }
    }
    free(rows); free(reach);
    return status;
}
