/* Randomized Walsh-Hadamard rotation of cgx's quantizer (cgx/quant/wire.py, "Rotation").
 *
 * In place on float32 values: the forward rotation flips the signs s_p, then runs the
 * butterflies h = 1, 2, .., m/2 over each block of m values; the inverse runs the same
 * butterflies, multiplies by 1/m (exact) and flips the signs. The butterflies run in
 * that fixed order with plain float32 adds (no reassociation: setup.py's flags), so the
 * result is bit-exact with kernels/reference.py's rotate() and the Triton kernel.
 *
 * Work is cut into units: unit u < n / block is the full block [u * block, (u+1) * block),
 * and unit n / block (when n % block != 0) is the tail, cut into power-of-two blocks,
 * largest first. Callers split the units across threads.
 */
#include <stdint.h>
#include <string.h>

#include "quant.h"

static uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* Flip the sign of v[i] where s_{start + i} = -1 (a sign-bit XOR: exact). */
static void flip_signs(float *v, int64_t start, int64_t m, uint32_t key) {
    uint32_t word = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t p = start + i;
        if (i == 0 || (p & 31) == 0) word = fmix32((uint32_t)(p >> 5) * 0x9E3779B1u + key);
        uint32_t u;
        memcpy(&u, &v[i], 4);
        u ^= ((word >> (p & 31)) & 1u) << 31;
        memcpy(&v[i], &u, 4);
    }
}

/* The first three butterfly stages (h = 1, 2, 4) of each group of 8, in that order. */
static void butterflies8(float *v, int64_t m) {
    for (int64_t g = 0; g < m; g += 8) {
        float *x = v + g;
        float a[8], b[8];
        for (int j = 0; j < 8; j += 2) { a[j] = x[j] + x[j + 1]; a[j + 1] = x[j] - x[j + 1]; }
        for (int j = 0; j < 8; j += 4) {
            b[j] = a[j] + a[j + 2];
            b[j + 1] = a[j + 1] + a[j + 3];
            b[j + 2] = a[j] - a[j + 2];
            b[j + 3] = a[j + 1] - a[j + 3];
        }
        for (int j = 0; j < 4; j++) { x[j] = b[j] + b[j + 4]; x[j + 4] = b[j] - b[j + 4]; }
    }
}

static void butterflies(float *v, int64_t m) {
    int64_t h = 1;
    if (m >= 8) {
        butterflies8(v, m);
        h = 8;
    }
    for (; h < m; h <<= 1) {
        for (int64_t i = 0; i < m; i += 2 * h) {
            float *x = v + i, *y = v + i + h;
            for (int64_t j = 0; j < h; j++) {
                float a = x[j], b = y[j];
                x[j] = a + b;
                y[j] = a - b;
            }
        }
    }
}

static void rotate_block(float *v, int64_t start, int64_t m, uint32_t key, int inverse) {
    if (!inverse) {
        flip_signs(v, start, m, key);
        butterflies(v, m);
        return;
    }
    butterflies(v, m);
    const float scale = 1.0f / (float)m;
    for (int64_t i = 0; i < m; i++) v[i] *= scale;
    flip_signs(v, start, m, key);
}

int cgx_rotate(float *v, int64_t n, int64_t block, uint32_t key, int inverse,
               int64_t unit_begin, int64_t unit_end) {
    if (n < 0 || block < 1 || (block & (block - 1)) || block > (1 << 24)) return CGX_EINVAL;
    int64_t full = n / block, units = full + (n % block != 0);
    if (unit_begin < 0 || unit_end > units || unit_begin > unit_end) return CGX_EINVAL;
    for (int64_t u = unit_begin; u < unit_end && u < full; u++)
        rotate_block(v + u * block, u * block, block, key, inverse);
    if (unit_end > full) { /* the tail: power-of-two blocks, largest first */
        int64_t start = full * block;
        for (int64_t m = block >> 1; m >= 1; m >>= 1) {
            if ((n - full * block) & m) {
                rotate_block(v + start, start, m, key, inverse);
                start += m;
            }
        }
    }
    return CGX_OK;
}
