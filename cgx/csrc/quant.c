/* Fused max-min bucket quantization on the CPU (wire format v1).
 *
 * One pass per bucket: the bucket is read once for min/max and the non-finite
 * check, then again (now from L1/L2) to quantize and pack, so memory traffic is
 * one read of the input and one write of the payload. The arithmetic follows
 * cgx/quant/wire.py bit for bit: float64 unit, IEEE 1/unit, separate
 * float32 multiply and add (setup.py compiles with -ffp-contract=off, so no FMA),
 * clamp then truncate, round-to-nearest-even float16/bfloat16 conversions.
 *
 * SIMD without -march=native: the kernels are written with GCC vector
 * extensions over 8 float lanes (one group of 8 codes = `bits` packed bytes)
 * and compiled twice, for AVX2+F16C and for the baseline ISA (SSE2 on x86-64,
 * NEON on aarch64); the AVX2 build is picked at run time when the CPU has it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cgx packs codes with little-endian word stores; big-endian hosts are not supported"
#endif
#if !defined(__FLT16_MANT_DIG__)
#error "cgx's C path needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64/aarch64)"
#endif

#if defined(__x86_64__)
#define CGX_X86 1
#include <immintrin.h>
#else
#define CGX_X86 0
#endif

/* 32-byte vectors only travel between always-inline functions, so the
 * "AVX vector return without AVX changes the ABI" note does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define CGX_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef _Float16 v8h __attribute__((vector_size(16)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static const uint32_t NAN32_BITS = 0x7FC00000u; /* the NaN the reference writes in meta */

/* ---------------------------------------------------------------- helpers */

/* Broadcast. Written as an integer "vector + scalar" (which GCC lowers to one
 * broadcast) because the {v, v, ...} literal is rebuilt lane by lane inside
 * loops; integer addition of 0 keeps every bit, -0.0 and NaN included. */
CGX_INLINE v8f splat(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (v8f)((v8u){0} + u);
}

CGX_INLINE v8f select_f(v8i mask, v8f a, v8f b) {
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* Stochastic-rounding offsets, exactly wire.noise(): one murmur3 fmix32 hash per
 * two values 8 positions apart. Position p (from the tensor's start) hashes the
 * counter c = off + (p >> 4) * 8 + (p & 7); the group of 8 at p uses the hash's
 * low 16 bits when (p >> 3) is even, its high 16 bits when odd. The counter's
 * multiply is linear, so it is carried from block to block as a running sum
 * (mod 2^32): noise_open() once per bucket, noise_next() per group of 8, which
 * hashes once per block of 16. */
typedef struct {
    v8u ctr;  /* the current block's c * 0x9E3779B1 + key, per lane */
    v8u hash; /* its hash, once computed */
    int high; /* the next group takes the high 16 bits */
} noise_stream;

CGX_INLINE v8u noise_hash(v8u h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* The stream of the groups from position p (a multiple of 8) on. */
CGX_INLINE noise_stream noise_open(uint32_t key, uint32_t off, int64_t p) {
    const v8u iota = {0, 1, 2, 3, 4, 5, 6, 7};
    noise_stream ns;
    ns.ctr = (iota + off + (uint32_t)((p >> 4) * 8)) * 0x9E3779B1u + key;
    ns.high = (int)((p >> 3) & 1);
    ns.hash = ns.high ? noise_hash(ns.ctr) : ns.ctr; /* p starts a block's second half */
    return ns;
}

CGX_INLINE v8f noise_next(noise_stream *ns) {
    if (!ns->high) ns->hash = noise_hash(ns->ctr);
    v8u u = ns->high ? ns->hash >> 16 : ns->hash & 0xFFFFu;
    if (ns->high) ns->ctr += 8u * 0x9E3779B1u; /* the next block's counters */
    ns->high ^= 1;
    /* < 2^16: the signed conversion is exact */
    return __builtin_convertvector((v8i)u, v8f) * splat(1.0f / 65536.0f);
}

#define CGX_SWITCH_BITS_DT(CALL)                                  \
    switch (dt) {                                                 \
    case CGX_DT_FLOAT32: CGX_SWITCH_BITS(CALL, CGX_DT_FLOAT32) break;   \
    case CGX_DT_FLOAT16: CGX_SWITCH_BITS(CALL, CGX_DT_FLOAT16) break;   \
    default: CGX_SWITCH_BITS(CALL, CGX_DT_BFLOAT16) break;              \
    }
#define CGX_SWITCH_BITS(CALL, DT)                     \
    switch (bits) {                                   \
    case 1: CALL(1, DT); break;                       \
    case 2: CALL(2, DT); break;                       \
    case 3: CALL(3, DT); break;                       \
    case 4: CALL(4, DT); break;                       \
    case 5: CALL(5, DT); break;                       \
    case 6: CALL(6, DT); break;                       \
    case 7: CALL(7, DT); break;                       \
    default: CALL(8, DT); break;                      \
    }

/* ---------------------------------------------------------------- kernels */

#define CGX_SIMD 0
#define CGX_FN(name) name##_generic
#include "quant_impl.h"
#undef CGX_FN
#undef CGX_SIMD

#if CGX_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
#define CGX_SIMD 1
#define CGX_FN(name) name##_avx2
#include "quant_impl.h"
#undef CGX_FN
#undef CGX_SIMD
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

typedef void (*quantize_fn)(void *, int, int64_t, int, int64_t, int, uint32_t, uint32_t,
                            int, uint8_t *, int64_t, int64_t);
typedef void (*dequantize_fn)(const uint8_t *, int64_t, int, int64_t, void *, int, int, int64_t,
                              int64_t);

static quantize_fn g_quantize = quantize_generic;
static dequantize_fn g_dequantize = dequantize_generic;
static const char *g_path = "generic";

/* Runs when the shared object is loaded (by ctypes or by import), before any
 * call, so the pointers never change while threads use them. */
__attribute__((constructor)) static void cgx_pick_path(void) {
#if CGX_X86
    __builtin_cpu_init();
#endif
    (void)cgx_set_simd_path(1); /* falls back to generic where AVX2/F16C are missing */
}

/* ---------------------------------------------------------------- C API */

static int check_args(int64_t n, int bits, int64_t bucket_size, int dtype, int64_t b0,
                      int64_t b1) {
    if (n < 0 || bits < 1 || bits > 8 || bucket_size < 8 || bucket_size % 8 != 0) return CGX_EINVAL;
    if (dtype < CGX_DT_FLOAT32 || dtype > CGX_DT_BFLOAT16) return CGX_EINVAL;
    const int64_t nb = (n + bucket_size - 1) / bucket_size;
    if (b0 < 0 || b0 > b1 || b1 > nb) return CGX_EINVAL;
    return CGX_OK;
}

int cgx_quantize(void *x, int dtype, int64_t n, int bits, int64_t bucket_size,
                 int stochastic, uint32_t key, uint32_t index_offset, int write_back,
                 uint8_t *payload, int64_t bucket_begin, int64_t bucket_end) {
    int rc = check_args(n, bits, bucket_size, dtype, bucket_begin, bucket_end);
    if (rc != CGX_OK) return rc;
    g_quantize(x, dtype, n, bits, bucket_size, stochastic != 0, key, index_offset,
               write_back != 0, payload, bucket_begin, bucket_end);
    const int64_t nb = (n + bucket_size - 1) / bucket_size;
    if (bucket_end == nb) {
        /* zero the padding up to the segment's 8-byte alignment */
        const int64_t raw = 8 * nb + (n + 7) / 8 * bits;
        const int64_t size = (raw + 7) / 8 * 8;
        memset(payload + raw, 0, (size_t)(size - raw));
    }
    return CGX_OK;
}

int cgx_dequantize(const uint8_t *payload, int64_t n, int bits, int64_t bucket_size, void *out,
                   int dtype, int accumulate, int64_t bucket_begin, int64_t bucket_end) {
    int rc = check_args(n, bits, bucket_size, dtype, bucket_begin, bucket_end);
    if (rc != CGX_OK) return rc;
    g_dequantize(payload, n, bits, bucket_size, out, dtype, accumulate != 0, bucket_begin,
                 bucket_end);
    return CGX_OK;
}

const char *cgx_simd_path(void) { return g_path; }

int cgx_set_simd_path(int avx2) {
    if (!avx2) {
        g_quantize = quantize_generic;
        g_dequantize = dequantize_generic;
        g_path = "generic";
        return CGX_OK;
    }
#if CGX_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        g_quantize = quantize_avx2;
        g_dequantize = dequantize_avx2;
        g_path = "avx2";
        return CGX_OK;
    }
#endif
    return CGX_EINVAL;
}

/* A legal (empty) extension module, so that `cgx._cquant` builds and installs
 * like any other; the functions above are reached through ctypes. */
static struct PyModuleDef cquant_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cquant",
    .m_doc = "Fused C quantization kernels of cgx; used through ctypes by cgx.compression.cpu.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__cquant(void) { return PyModule_Create(&cquant_module); }
