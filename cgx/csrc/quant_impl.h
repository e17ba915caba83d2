/* Kernel bodies of cgx/csrc/quant.c, included once per instruction set.
 *
 * Not a normal header: quant.c includes it twice, with
 *   CGX_SIMD = 0, CGX_FN(f) = f##_generic   (baseline ISA: SSE2 / NEON)
 *   CGX_SIMD = 1, CGX_FN(f) = f##_avx2      (inside `#pragma GCC target("avx2,f16c")`)
 * The arithmetic is the same in both; CGX_SIMD only swaps in AVX2/F16C
 * intrinsics where GCC's generic vector code is slow (pack/unpack of codes,
 * float16 conversion, min/max).
 */

/* ------------------------------------------------------------ lane helpers */

/* Lane-wise comparisons (all-ones or zero per lane; false when a lane is NaN,
 * except ne). Without AVX, GCC lowers a comparison of 32-byte vectors to one
 * scalar compare and branch per lane, so the generic build compares two
 * 16-byte halves, which SSE2 and NEON do natively. */
#if CGX_SIMD
#define CGX_CMP(name, op) \
    CGX_INLINE v8i CGX_FN(name)(v8f a, v8f b) { return a op b; }
#else
#define CGX_CMP(name, op)                                           \
    CGX_INLINE v8i CGX_FN(name)(v8f a, v8f b) {                     \
        v4f a0, a1, b0, b1;                                         \
        memcpy(&a0, &a, 16);                                        \
        memcpy(&a1, (const char *)&a + 16, 16);                     \
        memcpy(&b0, &b, 16);                                        \
        memcpy(&b1, (const char *)&b + 16, 16);                     \
        v4i r0 = a0 op b0, r1 = a1 op b1;                           \
        v8i r;                                                      \
        memcpy(&r, &r0, 16);                                        \
        memcpy((char *)&r + 16, &r1, 16);                           \
        return r;                                                   \
    }
#endif
CGX_CMP(lt, <)
CGX_CMP(gt, >)
CGX_CMP(ne, !=)
#undef CGX_CMP

CGX_INLINE v8f CGX_FN(vmin)(v8f a, v8f b) {
#if CGX_SIMD
    return (v8f)_mm256_min_ps((__m256)a, (__m256)b); /* a < b ? a : b */
#else
    return select_f(CGX_FN(lt)(a, b), a, b);
#endif
}

CGX_INLINE v8f CGX_FN(vmax)(v8f a, v8f b) {
#if CGX_SIMD
    return (v8f)_mm256_max_ps((__m256)a, (__m256)b); /* a > b ? a : b */
#else
    return select_f(CGX_FN(gt)(a, b), a, b);
#endif
}

/* float32 -> bfloat16, round to nearest even; NaN -> 0x7FC0 (what torch writes). */
CGX_INLINE v8u16 CGX_FN(to_bf16)(v8f v) {
    v8u u = (v8u)v;
    v8u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    v8u nan = (v8u)CGX_FN(ne)(v, v);
    return __builtin_convertvector((nan & 0x7FC0u) | (~nan & rounded), v8u16);
}

CGX_INLINE v8f CGX_FN(half_to_f32)(v8h h) {
#if CGX_SIMD
    __m128i raw;
    memcpy(&raw, &h, sizeof raw);
    return (v8f)_mm256_cvtph_ps(raw);
#else
    return __builtin_convertvector(h, v8f);
#endif
}

CGX_INLINE v8h CGX_FN(f32_to_half)(v8f v) {
#if CGX_SIMD
    /* round to nearest even, exceptions suppressed: IEEE like the scalar cast */
    __m128i raw = _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v8h h;
    memcpy(&h, &raw, sizeof h);
    return h;
#else
    return __builtin_convertvector(v, v8h);
#endif
}

/* Load 8 values of dtype `dt` at element i of p, widened to float32 (exact). */
CGX_INLINE v8f CGX_FN(load8)(const void *p, int64_t i, const int dt) {
    if (dt == CGX_DT_FLOAT32) {
        v8f v;
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    if (dt == CGX_DT_BFLOAT16) {
        v8u16 h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return (v8f)(__builtin_convertvector(h, v8u) << 16);
    }
    v8h h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return CGX_FN(half_to_f32)(h);
}

/* Load count (1..8) values; the missing lanes are `pad`. */
CGX_INLINE v8f CGX_FN(load_partial)(const void *p, int64_t i, int count, const int dt, float pad) {
    const size_t esize = dt == CGX_DT_FLOAT32 ? 4 : 2;
    unsigned char buf[32] = {0};
    memcpy(buf, (const unsigned char *)p + i * (int64_t)esize, (size_t)count * esize);
    v8f v = CGX_FN(load8)(buf, 0, dt);
    for (int j = count; j < 8; j++) v[j] = pad;
    return v;
}

/* Store the first `count` (1..8) lanes at element i of p as dtype `dt` (RNE). */
CGX_INLINE void CGX_FN(store8)(void *p, int64_t i, v8f v, const int dt, const int count) {
    if (dt == CGX_DT_FLOAT32) {
        memcpy((float *)p + i, &v, (size_t)count * 4);
    } else if (dt == CGX_DT_BFLOAT16) {
        v8u16 h = CGX_FN(to_bf16)(v);
        memcpy((uint16_t *)p + i, &h, (size_t)count * 2);
    } else {
        v8h h = CGX_FN(f32_to_half)(v);
        memcpy((uint16_t *)p + i, &h, (size_t)count * 2);
    }
}

/* Pack 8 codes (< 2^bits) into `bits` bytes: code j at bits [j*bits, (j+1)*bits)
 * of a little-endian word. `bits` is a compile-time constant in every caller.
 * With `spill` and bits = 5, 6 or 7 the whole 8-byte word is stored (one store
 * instead of two or three); the 8 - bits < bits bytes past the group belong to
 * the next group of the same bucket, whose store rewrites them, so callers pass
 * it for every group but a bucket's last. */
CGX_INLINE void CGX_FN(pack8)(v8i q, uint8_t *dst, const int bits, const int spill) {
    uint64_t w;
#if CGX_SIMD
    __m256i qi = (__m256i)q;
    if (bits <= 4) {
        /* 8 codes fit a 32-bit word: shift each to its place, OR the lanes */
        __m256i a = _mm256_sllv_epi32(qi, _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits,
                                                             4 * bits, 5 * bits, 6 * bits,
                                                             7 * bits));
        __m128i d = _mm_or_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        d = _mm_or_si128(d, _mm_shuffle_epi32(d, 0x4E));
        d = _mm_or_si128(d, _mm_shuffle_epi32(d, 0xB1));
        w = (uint32_t)_mm_cvtsi128_si32(d);
    } else if (bits == 8) {
        /* one byte per code: gather byte 0 of each 32-bit lane within each half */
        const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                              -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                              -1, -1, -1, -1, -1, -1);
        __m256i t = _mm256_shuffle_epi8(qi, pick);
        w = (uint64_t)(uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(t)) |
            (uint64_t)(uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(t, 1)) << 32;
    } else {
        /* 64-bit lane k holds codes 2k (low half) and 2k+1 (high half): join them
         * into one 2*bits-bit value, shift the four values to their places, OR */
        __m256i pair = _mm256_or_si256(_mm256_srli_epi64(qi, 32 - bits),
                                       _mm256_and_si256(qi, _mm256_set1_epi64x(0xFFFFFFFF)));
        __m256i c = _mm256_sllv_epi64(pair, _mm256_setr_epi64x(0, 2 * bits, 4 * bits, 6 * bits));
        __m128i d = _mm_or_si128(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        d = _mm_or_si128(d, _mm_unpackhi_epi64(d, d));
        w = (uint64_t)_mm_cvtsi128_si64(d);
    }
#else
    uint32_t lanes[8];
    memcpy(lanes, &q, sizeof lanes);
    w = 0;
    for (int j = 0; j < 8; j++) w |= (uint64_t)lanes[j] << (j * bits);
#endif
    if (spill && bits > 4 && bits < 8)
        memcpy(dst, &w, 8);
    else
        memcpy(dst, &w, (size_t)bits);
}

/* Inverse of pack8, as float32 codes. */
CGX_INLINE v8f CGX_FN(unpack8)(const uint8_t *src, const int bits) {
    uint64_t w = 0;
    memcpy(&w, src, (size_t)bits);
#if CGX_SIMD
    /* lane j takes bytes k, k+1 (k = j*bits/8) of the word, then shifts by j*bits % 8;
     * a code of <= 8 bits never spans more than 2 bytes */
#define CGX_K(j) ((j) * bits / 8)
#define CGX_CTRL(j) (int)(CGX_K(j) | ((CGX_K(j) + 1) << 8) | (0x80u << 16) | (0x80u << 24))
    const __m256i ctrl = _mm256_setr_epi32(CGX_CTRL(0), CGX_CTRL(1), CGX_CTRL(2), CGX_CTRL(3),
                                           CGX_CTRL(4), CGX_CTRL(5), CGX_CTRL(6), CGX_CTRL(7));
#undef CGX_CTRL
#undef CGX_K
    const __m256i shift = _mm256_setr_epi32(0, bits % 8, 2 * bits % 8, 3 * bits % 8,
                                            4 * bits % 8, 5 * bits % 8, 6 * bits % 8,
                                            7 * bits % 8);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)w), ctrl);
    v = _mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32((1 << bits) - 1));
    return (v8f)_mm256_cvtepi32_ps(v);
#else
    /* a vector literal, not a round trip through memory: 8 narrow stores then one
     * wide load would stall on store forwarding */
    const uint64_t mask = (1u << bits) - 1u;
#define CGX_CODE(j) (int32_t)((w >> ((j) * bits)) & mask)
    v8i q = {CGX_CODE(0), CGX_CODE(1), CGX_CODE(2), CGX_CODE(3),
             CGX_CODE(4), CGX_CODE(5), CGX_CODE(6), CGX_CODE(7)};
#undef CGX_CODE
    return __builtin_convertvector(q, v8f);
#endif
}

/* ------------------------------------------------------------ one bucket */

/* Codes of 8 values: trunc(clamp((v - lo) * inv + r, 0, L)). */
CGX_INLINE v8i CGX_FN(encode8)(v8f v, v8f lo, v8f inv, v8f levels, v8f r) {
    v8f y = (v - lo) * inv + r; /* two roundings: -ffp-contract=off forbids an FMA */
    /* clamp: vmax(y, 0) maps NaN to 0 (NaN only arises when bits == 1 and the
     * bucket's range overflows float32; such a bucket decodes to NaN anyway) */
    y = CGX_FN(vmin)(CGX_FN(vmax)(y, splat(0.0f)), levels);
    return __builtin_convertvector(y, v8i); /* truncation toward zero */
}

/* One bucket: x[s, s + len) -> meta (8 bytes) + codes. len % 8 != 0 only for
 * the last bucket of a segment. */
CGX_INLINE void CGX_FN(quantize_bucket)(void *x, int64_t s, int64_t len, uint8_t *meta,
                                        uint8_t *codes, uint32_t key, uint32_t off,
                                        const int bits, const int dt, const int stochastic,
                                        const int write_back, const int64_t prefetch_bytes) {
    const int64_t full = len & ~(int64_t)7;
    const int rest = (int)(len - full);

    /* pass 1: min, max and "any non-finite". vmin/vmax skip NaN lanes, so
     * non-finite values are caught apart: z accumulates v - v, which is 0 for
     * finite v and NaN (sticky under +) for inf and NaN. Two sets of
     * accumulators halve the loop-carried dependency chains. */
    v8f lo0 = splat(__builtin_inff()), hi0 = splat(-__builtin_inff()), z0 = splat(0.0f);
    v8f lo1 = lo0, hi1 = hi0, z1 = z0;
    int64_t i = 0;
    for (; i + 16 <= full; i += 16) {
        v8f a = CGX_FN(load8)(x, s + i, dt), b = CGX_FN(load8)(x, s + i + 8, dt);
        lo0 = CGX_FN(vmin)(a, lo0);
        hi0 = CGX_FN(vmax)(a, hi0);
        z0 = z0 + (a - a);
        lo1 = CGX_FN(vmin)(b, lo1);
        hi1 = CGX_FN(vmax)(b, hi1);
        z1 = z1 + (b - b);
    }
    for (; i < full; i += 8) {
        v8f a = CGX_FN(load8)(x, s + i, dt);
        lo0 = CGX_FN(vmin)(a, lo0);
        hi0 = CGX_FN(vmax)(a, hi0);
        z0 = z0 + (a - a);
    }
    if (rest) {
        /* pad with the bucket's first value: neutral for min, max and finiteness */
        float first = CGX_FN(load_partial)(x, s, 1, dt, 0.0f)[0];
        v8f a = CGX_FN(load_partial)(x, s + full, rest, dt, first);
        lo0 = CGX_FN(vmin)(a, lo0);
        hi0 = CGX_FN(vmax)(a, hi0);
        z0 = z0 + (a - a);
    }
    /* horizontal reductions through arrays: lane indexing of a loop-carried
     * vector makes GCC keep it in memory for the whole loop */
    float lanes_lo[8], lanes_hi[8], lanes_z[8];
    v8f vlo = CGX_FN(vmin)(lo1, lo0), vhi = CGX_FN(vmax)(hi1, hi0), vz = z0 + z1;
    memcpy(lanes_lo, &vlo, sizeof lanes_lo);
    memcpy(lanes_hi, &vhi, sizeof lanes_hi);
    memcpy(lanes_z, &vz, sizeof lanes_z);
    float lo = lanes_lo[0], hi = lanes_hi[0];
    int any_bad = lanes_z[0] != lanes_z[0];
    for (int j = 1; j < 8; j++) {
        lo = lanes_lo[j] < lo ? lanes_lo[j] : lo;
        hi = lanes_hi[j] > hi ? lanes_hi[j] : hi;
        any_bad |= lanes_z[j] != lanes_z[j];
    }

    if (any_bad) {
        /* non-finite policy: (NaN, NaN) meta and zero codes: the bucket decodes to NaN */
        float nan;
        memcpy(&nan, &NAN32_BITS, 4);
        memcpy(meta, &nan, 4);
        memcpy(meta + 4, &nan, 4);
        memset(codes, 0, (size_t)((len + 7) / 8 * bits));
        if (write_back) {
            for (int64_t i = 0; i < len; i += 8)
                CGX_FN(store8)(x, s + i, splat(nan), dt, len - i >= 8 ? 8 : rest);
        }
        return;
    }

    float unit = (float)(((double)hi - (double)lo) / (double)((1 << bits) - 1));
    if (unit < FLT_MIN) unit = 0.0f; /* constant bucket: every code 0, decodes to lo */
    const float inv = unit > 0.0f ? 1.0f / unit : 0.0f; /* IEEE division */
    memcpy(meta, &unit, 4);
    memcpy(meta + 4, &lo, 4);

    const v8f vlo1 = splat(lo), vinv = splat(inv), vunit = splat(unit);
    const v8f levels = splat((float)((1 << bits) - 1));

    /* pass 2 (the bucket is now in L1/L2): codes, and decoded values for write_back.
     * It also prefetches the next bucket (`ahead` bytes further), so that pass 1 of
     * the next bucket reads from cache and pass 2's arithmetic overlaps memory. */
    noise_stream noise = {{0}, {0}, 0};
    if (stochastic) noise = noise_open(key, off, s);
    const int esize = dt == CGX_DT_FLOAT32 ? 4 : 2;
    const char *ahead = (const char *)x + (s + len) * esize;
    for (int64_t i = 0; i < full; i += 8) {
        if ((i & 15) == 0 && i * esize < prefetch_bytes)
            __builtin_prefetch(ahead + i * esize, 0, 3);
        const v8f r = stochastic ? noise_next(&noise) : splat(0.5f);
        v8i q = CGX_FN(encode8)(CGX_FN(load8)(x, s + i, dt), vlo1, vinv, levels, r);
        CGX_FN(pack8)(q, codes + i / 8 * bits, bits, i + 8 < full || rest);
        if (write_back)
            CGX_FN(store8)(x, s + i, vlo1 + vunit * __builtin_convertvector(q, v8f), dt, 8);
    }
    if (rest) {
        v8f v = CGX_FN(load_partial)(x, s + full, rest, dt, lo);
        const v8f r = stochastic ? noise_next(&noise) : splat(0.5f);
        v8i q = CGX_FN(encode8)(v, vlo1, vinv, levels, r);
        for (int j = rest; j < 8; j++) q[j] = 0; /* padding codes are zero */
        CGX_FN(pack8)(q, codes + full / 8 * bits, bits, 0);
        if (write_back)
            CGX_FN(store8)(x, s + full, vlo1 + vunit * __builtin_convertvector(q, v8f), dt, rest);
    }
}

CGX_INLINE void CGX_FN(dequantize_bucket)(const uint8_t *meta, const uint8_t *codes, void *out,
                                          int64_t s, int64_t len, const int bits, const int dt,
                                          const int accumulate) {
    float unit, lo;
    memcpy(&unit, meta, 4);
    memcpy(&lo, meta + 4, 4);
    const v8f vunit = splat(unit), vlo = splat(lo);
    const int64_t full = len & ~(int64_t)7;
    const int rest = (int)(len - full);
    for (int64_t i = 0; i < full; i += 8) {
        v8f d = vlo + vunit * CGX_FN(unpack8)(codes + i / 8 * bits, bits);
        if (accumulate) d = CGX_FN(load8)(out, s + i, dt) + d;
        CGX_FN(store8)(out, s + i, d, dt, 8);
    }
    if (rest) {
        v8f d = vlo + vunit * CGX_FN(unpack8)(codes + full / 8 * bits, bits);
        if (accumulate) d = CGX_FN(load_partial)(out, s + full, rest, dt, 0.0f) + d;
        CGX_FN(store8)(out, s + full, d, dt, rest);
    }
}

/* ------------------------------------------------------------ bucket ranges */

/* Instantiated per (bits, dtype, rounding) so that the shifts, conversions and
 * the noise of the inner loops are compile-time constants; write_back stays a
 * run-time flag (one predictable branch per 8 values; specializing it too
 * doubled the build time for no measurable gain). */
CGX_INLINE void CGX_FN(quantize_range)(void *x, int64_t n, int64_t bucket_size, uint8_t *payload,
                                       int64_t b0, int64_t b1, uint32_t key, uint32_t index_offset,
                                       const int bits, const int dt, const int stochastic,
                                       const int write_back) {
    const int64_t nb = (n + bucket_size - 1) / bucket_size;
    uint8_t *codes = payload + 8 * nb;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = b * bucket_size;
        const int64_t len = n - s < bucket_size ? n - s : bucket_size;
        /* bytes of the next bucket that exist (none after the last one) */
        const int64_t next = n - (s + len) < bucket_size ? n - (s + len) : bucket_size;
        const int64_t pf = b + 1 < b1 ? next * (dt == CGX_DT_FLOAT32 ? 4 : 2) : 0;
        CGX_FN(quantize_bucket)(x, s, len, payload + 8 * b, codes + s / 8 * bits, key,
                                index_offset, bits, dt, stochastic, write_back, pf);
    }
}

CGX_INLINE void CGX_FN(dequantize_range)(const uint8_t *payload, int64_t n, int64_t bucket_size,
                                         void *out, int64_t b0, int64_t b1, const int bits,
                                         const int dt, const int accumulate) {
    const int64_t nb = (n + bucket_size - 1) / bucket_size;
    const uint8_t *codes = payload + 8 * nb;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = b * bucket_size;
        const int64_t len = n - s < bucket_size ? n - s : bucket_size;
        CGX_FN(dequantize_bucket)(payload + 8 * b, codes + s / 8 * bits, out, s, len, bits, dt,
                                  accumulate);
    }
}

#define CGX_Q_CALL(B, DT)                                                                  \
    do {                                                                                   \
        if (stochastic)                                                                    \
            CGX_FN(quantize_range)(x, n, bucket_size, payload, b0, b1, key, index_offset,  \
                                   B, DT, 1, write_back);                                  \
        else                                                                               \
            CGX_FN(quantize_range)(x, n, bucket_size, payload, b0, b1, key, index_offset,  \
                                   B, DT, 0, write_back);                                  \
    } while (0)
#define CGX_D_CALL(B, DT)                                                                   \
    do {                                                                                    \
        if (accumulate)                                                                     \
            CGX_FN(dequantize_range)(payload, n, bucket_size, out, b0, b1, B, DT, 1);       \
        else                                                                                \
            CGX_FN(dequantize_range)(payload, n, bucket_size, out, b0, b1, B, DT, 0);       \
    } while (0)

static void CGX_FN(quantize)(void *x, int dt, int64_t n, int bits, int64_t bucket_size,
                             int stochastic, uint32_t key, uint32_t index_offset, int write_back,
                             uint8_t *payload, int64_t b0, int64_t b1) {
    CGX_SWITCH_BITS_DT(CGX_Q_CALL)
}

static void CGX_FN(dequantize)(const uint8_t *payload, int64_t n, int bits, int64_t bucket_size,
                               void *out, int dt, int accumulate, int64_t b0, int64_t b1) {
    CGX_SWITCH_BITS_DT(CGX_D_CALL)
}

#undef CGX_Q_CALL
#undef CGX_D_CALL
