/* Fused CPU quantization of cgx (wire format v1, see cgx/compression/wire.py).
 *
 * Plain C functions, called through ctypes by cgx/compression/cpu.py (ctypes
 * releases the GIL for the duration of a call, so several Python threads can
 * work on disjoint bucket ranges of one segment at the same time).
 *
 * Every function works on the bucket range [bucket_begin, bucket_end) of a
 * segment of n values, so a caller can split a segment at bucket boundaries
 * across threads: ranges write disjoint bytes of the payload (buckets start on
 * byte boundaries because bucket_size % 8 == 0) and disjoint values of x/out.
 *
 * Pointers need no alignment. The payload is little-endian (as on the wire);
 * the build refuses big-endian hosts.
 */
#ifndef CGX_QUANT_H
#define CGX_QUANT_H

#include <stdint.h>

/* dtype codes of the value buffers (x of quantize, out of dequantize) */
#define CGX_DT_FLOAT32 0
#define CGX_DT_FLOAT16 1
#define CGX_DT_BFLOAT16 2

/* return codes */
#define CGX_OK 0
#define CGX_EINVAL (-1) /* bits, bucket_size, dtype or range out of bounds */

/* Quantize buckets [bucket_begin, bucket_end) of x (n values of dtype) into the
 * segment at payload (wire.packed_nbytes(n, bits, bucket_size) bytes).
 * stochastic: r = wire.noise(key, index_offset, i), else r = 0.5.
 * write_back: also overwrite x with the decoded values (fused requantize).
 * The range that ends at the last bucket also zeroes the segment's padding. */
int cgx_quantize(void *x, int dtype, int64_t n, int bits, int64_t bucket_size,
                 int stochastic, uint32_t key, uint32_t index_offset, int write_back,
                 uint8_t *payload, int64_t bucket_begin, int64_t bucket_end);

/* Decode buckets [bucket_begin, bucket_end) of a segment into out (n values of
 * dtype): out = lo + unit * q, or with accumulate out = dtype(float(out) + that). */
int cgx_dequantize(const uint8_t *payload, int64_t n, int bits, int64_t bucket_size,
                   void *out, int dtype, int accumulate, int64_t bucket_begin,
                   int64_t bucket_end);

/* Randomized Hadamard rotation (wire.py, "Rotation") of the float32 values v (n of
 * them) in place, forward or inverse, with Hadamard blocks of `block` values (a power
 * of two): units [unit_begin, unit_end) of the n / block full blocks, and unit
 * n / block for the tail (when n % block != 0). Defined in rotate.c. */
int cgx_rotate(float *v, int64_t n, int64_t block, uint32_t key, int inverse,
               int64_t unit_begin, int64_t unit_end);

/* Name of the code path in use ("avx2" or "generic"); the best one the CPU
 * supports is picked when the library is loaded. */
const char *cgx_simd_path(void);

/* Switch to the AVX2 (avx2 != 0) or the generic path; CGX_EINVAL when the CPU
 * lacks AVX2/F16C. Not thread-safe: for tests and benchmarks only. */
int cgx_set_simd_path(int avx2);

/* Multiple-choice knapsack of cgx/policy/levels/solver.py: per layer l one of the
 * candidates offsets[l]..offsets[l+1]-1 (costs, integer error units), least
 * total cost with total units <= capacity; the local candidate index per layer
 * goes to choice. Returns 0, 1 when no choice fits, -1 when out of memory
 * ((layers + 1) x (capacity + 1) doubles are kept for backtracking). */
int cgx_knapsack(int64_t layers, const int64_t *offsets, const double *costs,
                 const int64_t *units, int64_t capacity, int32_t *choice);

#endif
