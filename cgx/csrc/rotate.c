/* Randomized Walsh-Hadamard rotation of cgx's quantizer (cgx/quant/wire.py, "Rotation").
 *
 * In place on float32 values: the forward rotation flips the signs s_p, then runs the
 * butterflies h = 1, 2, .., m/2 over each block of m values; the inverse runs the same
 * butterflies, multiplies by 1/m (exact) and flips the signs. The butterflies run in
 * that fixed order with plain float32 adds (no reassociation: setup.py's flags), so the
 * result is bit-exact with kernels/reference.py's rotate() and the Triton kernel.
 *
 * Signs: one hash word gives the signs of 32 positions; each word's lanes get their
 * sign bit XORed through a mask table (no per-value branch: the loop vectorizes), and
 * the inverse multiplies by 1/m in the same pass.
 *
 * Butterflies (with GCC/clang vector extensions: 4 floats a vector, SSE2 on x86-64):
 * one pass does stages h = 1, 2, 4, 8 (those below m) of each group of 16 values held
 * as four vectors (rows of 4 values): a 4x4 transpose puts the values 1 and 2 apart in
 * different vectors, so h = 1, 2 are vector adds; a transpose back, then h = 4, 8. The
 * later stages go two at a time (radix 4: stages h and 2h over x[j], x[j+h], x[j+2h],
 * x[j+3h], kept in registers), with one lone stage last when their count is odd. Every
 * output is the same float add or sub of the same two values as in the plain stage-by-
 * stage loop, so the grouping changes no bit. Blocks that do not fill groups of 16 (and
 * compilers without vector extensions) take that plain loop.
 *
 * Full blocks smaller than SPAN values go SPAN values (several blocks) at a time, so the
 * sign pass sees whole hash words and groups of 16 hold whole blocks: each value still
 * gets its sign flip and stages in the same order. While a span's first butterfly pass
 * runs, the next span is prefetched (the pass is compute-bound, the stream memory-bound).
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

#define SIGN_BIT 0x80000000u
#define BITS4(k) 1u << (k), 1u << ((k) + 1), 1u << ((k) + 2), 1u << ((k) + 3)
static const uint32_t lane_bit[32] = {BITS4(0),  BITS4(4),  BITS4(8),  BITS4(12),
                                      BITS4(16), BITS4(20), BITS4(24), BITS4(28)};

/* v[k] (times scale when scaled), its sign flipped where bit b0 + k of word is set,
 * for k < count (b0 + count <= 32). */
static inline void flip_lanes(float *v, uint32_t word, int b0, int count, int scaled,
                              float scale) {
    for (int k = 0; k < count; k++) {
        float f = scaled ? v[k] * scale : v[k];
        uint32_t u;
        memcpy(&u, &f, 4);
        u ^= (word & lane_bit[b0 + k]) ? SIGN_BIT : 0u;
        memcpy(&v[k], &u, 4);
    }
}

/* Flip the sign of v[i] where s_{start + i} = -1 (a sign-bit XOR: exact), after the
 * multiplication by scale when scaled. */
static inline void flip_signs(float *v, int64_t start, int64_t m, uint32_t key, int scaled,
                              float scale) {
    for (int64_t i = 0; i < m;) {
        int64_t p = start + i;
        uint32_t word = fmix32((uint32_t)(p >> 5) * 0x9E3779B1u + key);
        int b0 = (int)(p & 31);
        if (b0 == 0 && m - i >= 32) {
            flip_lanes(v + i, word, 0, 32, scaled, scale); /* a whole word: unrolled */
            i += 32;
        } else {
            int count = m - i < 32 - b0 ? (int)(m - i) : 32 - b0;
            flip_lanes(v + i, word, b0, count, scaled, scale);
            i += count;
        }
    }
}

/* All stages h = 1, 2, .., m/2 one after the other: the definition. */
static void butterflies_plain(float *v, int64_t m) {
    for (int64_t h = 1; h < m; h <<= 1) {
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

#if defined(__GNUC__) /* GCC and clang: vector extensions */

typedef float v4f __attribute__((vector_size(16)));
#if defined(__clang__)
#define SHUFFLE(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
typedef int32_t v4i __attribute__((vector_size(16)));
#define SHUFFLE(a, b, i, j, k, l) __builtin_shuffle(a, b, (v4i){i, j, k, l})
#endif

static inline v4f load4(const float *p) {
    v4f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store4(float *p, v4f x) { memcpy(p, &x, sizeof x); }

/* Transpose the 4x4 matrix whose rows are x[0..3]. */
static inline void transpose4(v4f x[4]) {
    v4f t0 = SHUFFLE(x[0], x[1], 0, 4, 1, 5), t1 = SHUFFLE(x[0], x[1], 2, 6, 3, 7);
    v4f t2 = SHUFFLE(x[2], x[3], 0, 4, 1, 5), t3 = SHUFFLE(x[2], x[3], 2, 6, 3, 7);
    x[0] = SHUFFLE(t0, t2, 0, 1, 4, 5);
    x[1] = SHUFFLE(t0, t2, 2, 3, 6, 7);
    x[2] = SHUFFLE(t1, t3, 0, 1, 4, 5);
    x[3] = SHUFFLE(t1, t3, 2, 3, 6, 7);
}

/* One stage over x[0..3]: pairs (0, 1) and (2, 3). */
static inline void pairs01(v4f x[4]) {
    v4f a0 = x[0] + x[1], a1 = x[0] - x[1], a2 = x[2] + x[3], a3 = x[2] - x[3];
    x[0] = a0;
    x[1] = a1;
    x[2] = a2;
    x[3] = a3;
}

/* One stage over x[0..3]: pairs (0, 2) and (1, 3). */
static inline void pairs02(v4f x[4]) {
    v4f a0 = x[0] + x[2], a1 = x[1] + x[3], a2 = x[0] - x[2], a3 = x[1] - x[3];
    x[0] = a0;
    x[1] = a1;
    x[2] = a2;
    x[3] = a3;
}

/* Stages h = 1, 2, 4, 8 (those below m) of each group of 16 values of v[0 .. len),
 * prefetching next[0 .. next_len) (the values rotated next) one cache line a group. */
static void stages_1_to_8(float *v, int64_t len, int64_t m, const float *next,
                          int64_t next_len) {
    for (int64_t g = 0; g < len; g += 16) {
        if (g < next_len) __builtin_prefetch(next + g);
        v4f x[4];
        for (int k = 0; k < 4; k++) x[k] = load4(v + g + 4 * k);
        transpose4(x); /* x[k] holds values 4i + k: h = 1, 2 pair whole vectors */
        pairs01(x);
        if (m >= 4) pairs02(x);
        transpose4(x); /* back to x[k] = values 4k .. 4k + 3: h = 4, 8 */
        if (m >= 8) pairs01(x);
        if (m >= 16) pairs02(x);
        for (int k = 0; k < 4; k++) store4(v + g + 4 * k, x[k]);
    }
}

/* Stages h and 2h (h >= 4) of a block of m >= 4h values. */
static void stages_radix4(float *v, int64_t m, int64_t h) {
    for (int64_t i = 0; i < m; i += 4 * h) {
        for (float *p = v + i; p < v + i + h; p += 4) {
            v4f x[4];
            for (int k = 0; k < 4; k++) x[k] = load4(p + k * h);
            pairs01(x); /* stage h */
            pairs02(x); /* stage 2h */
            for (int k = 0; k < 4; k++) store4(p + k * h, x[k]);
        }
    }
}

/* Stage h (h >= 4) alone: the last one, m = 2h. */
static void stage_last(float *v, int64_t h) {
    for (float *p = v; p < v + h; p += 4) {
        v4f a = load4(p), b = load4(p + h);
        store4(p, a + b);
        store4(p + h, a - b);
    }
}

/* All the stages of each block of m values that tiles v[0 .. len) (next: as in
 * stages_1_to_8). */
static void butterflies(float *v, int64_t len, int64_t m, const float *next,
                        int64_t next_len) {
    if (m == 1) return;
    if (len % 16) { /* small blocks not filling whole groups of 16 */
        for (int64_t b = 0; b < len; b += m) butterflies_plain(v + b, m);
        return;
    }
    stages_1_to_8(v, len, m, next, next_len);
    for (int64_t b = 0; m > 16 && b < len; b += m) {
        int64_t h = 16;
        for (; 4 * h <= m; h *= 4) stages_radix4(v + b, m, h);
        if (h < m) stage_last(v + b, h);
    }
}

#else

static void butterflies(float *v, int64_t len, int64_t m, const float *next,
                        int64_t next_len) {
    (void)next, (void)next_len;
    for (int64_t b = 0; b < len; b += m) butterflies_plain(v + b, m);
}

#endif

/* Rotate the blocks of m values that tile v[0 .. len), positions start .. start + len;
 * the next next_len values (v[len ..]) are rotated next (prefetched meanwhile). */
static void rotate_blocks(float *v, int64_t start, int64_t len, int64_t m, uint32_t key,
                          int inverse, int64_t next_len) {
    if (!inverse) {
        flip_signs(v, start, len, key, 0, 1.0f);
        butterflies(v, len, m, v + len, next_len);
        return;
    }
    butterflies(v, len, m, v + len, next_len);
    flip_signs(v, start, len, key, 1, 1.0f / (float)m);
}

#define SPAN 256            /* small blocks go SPAN values at a time (L1-resident) */
#define PREFETCH_MAX 4096   /* no prefetch past larger spans (wire's blocks are <= 4096) */

int cgx_rotate(float *v, int64_t n, int64_t block, uint32_t key, int inverse,
               int64_t unit_begin, int64_t unit_end) {
    if (n < 0 || block < 1 || (block & (block - 1)) || block > (1 << 24)) return CGX_EINVAL;
    int64_t full = n / block, units = full + (n % block != 0);
    if (unit_begin < 0 || unit_end > units || unit_begin > unit_end) return CGX_EINVAL;
    int64_t per = block < SPAN ? SPAN / block : 1, last = unit_end < full ? unit_end : full;
    int64_t end = unit_end > full ? n : last * block; /* the values this call rotates end */
    for (int64_t u = unit_begin; u < last; u += per) {
        int64_t len = (last - u < per ? last - u : per) * block, at = u * block;
        int64_t ahead = len > PREFETCH_MAX ? 0 : end - (at + len);
        rotate_blocks(v + at, at, len, block, key, inverse, ahead < len ? ahead : len);
    }
    if (unit_end > full) { /* the tail: power-of-two blocks, largest first */
        int64_t start = full * block;
        for (int64_t m = block >> 1; m >= 1; m >>= 1) {
            if ((n - full * block) & m) {
                rotate_blocks(v + start, start, m, m, key, inverse, 0);
                start += m;
            }
        }
    }
    return CGX_OK;
}
