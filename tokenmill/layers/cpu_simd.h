/* Shared AVX2 + FMA helpers of the fused CPU kernels (cpu_ops.c, cpu_attention.c). */
#ifndef TM_CPU_SIMD_H
#define TM_CPU_SIMD_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for 8 floats: range reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial
 * for e^r (relative error ~2e-7, like libm expf to a few ulp), 2^n via the exponent bits.
 * Inputs below -87.3 give 0 (not denormals); -inf gives 0. */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2 with ln2 split in two for precision */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(underflow, y);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {   /* the largest of 8 lanes */
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float exp1(float x) {   /* scalar tail through the same polynomial */
    float buf[8] = {x, 0, 0, 0, 0, 0, 0, 0};
    _mm256_storeu_ps(buf, exp256(_mm256_loadu_ps(buf)));
    return buf[0];
}

static inline float dot_i8(const float *a, const int8_t *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + i))));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), v, acc);
    }
    float s = hsum256(acc);
    for (; i < D; i++) s += a[i] * (float)b[i];
    return s;
}

/* KV cache value types (tm_paged_attention's dt; cpu_ops.KV_DTYPE_CODES). */
enum { KV_F32 = 0, KV_I8 = 1, KV_F16 = 2, KV_BF16 = 3 };

static inline int64_t kv_elem_bytes(int dt) {
    return dt == KV_F32 ? 4 : dt == KV_I8 ? 1 : 2;
}

/* 8 values of a cache row from element i, widened to float32 (f16 by F16C; bf16 is the
 * high half of a float32; int8 unscaled). */
static inline __m256 kv_load8(const void *row, int64_t i, int dt) {
    if (dt == KV_F32) return _mm256_loadu_ps((const float *)row + i);
    if (dt == KV_I8)   /* the int8 values; the caller applies the row's scale */
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + i))));
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (dt == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#ifdef __AVX512F__
/* 16 values of a cache (or weight) row from element i, widened as kv_load8 widens them. */
static inline __m512 kv_load16(const void *row, int64_t i, int dt) {
    if (dt == KV_F32) return _mm512_loadu_ps((const float *)row + i);
    if (dt == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + i))));
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    if (dt == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static inline float kv_load1(const void *row, int64_t i, int dt) {
    if (dt == KV_F32) return ((const float *)row)[i];
    if (dt == KV_I8) return (float)((const int8_t *)row)[i];
    const uint16_t h = ((const uint16_t *)row)[i];
    if (dt == KV_F16) return _cvtsh_ss(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float dot_kv(const float *a, const void *row, int64_t D, int dt) {
    /* two independent FMA chains: one chain is latency-bound at head size 64 */
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_load8(row, i, dt), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), kv_load8(row, i + 8, dt), acc2);
    }
    for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_load8(row, i, dt), acc);
    float s = hsum256(_mm256_add_ps(acc, acc2));
    for (; i < D; i++) s += a[i] * kv_load1(row, i, dt);
    return s;
}

static inline void axpy_kv(float w, const void *row, float *y, int64_t D, int dt) {
    const __m256 vw = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vw, kv_load8(row, i, dt), _mm256_loadu_ps(y + i)));
    for (; i < D; i++) y[i] += w * kv_load1(row, i, dt);
}

static inline float dot(const float *a, const float *b, int64_t D) {
    return dot_kv(a, b, D, KV_F32);
}

/* float32 -> f16 / bf16, rounded to nearest even as torch's .to() (bf16 NaN: 0x7fc0). */
static inline void kv_store_row(const float *x, void *dst, int64_t n, int dt) {
    if (dt == KV_F32) { memcpy(dst, x, sizeof(float) * (size_t)n); return; }
    uint16_t *out = (uint16_t *)dst;
    int64_t i = 0;
    if (dt == KV_F16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
        return;
    }
    for (; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) { out[i] = 0x7fc0; continue; }
        bits += 0x7fffu + ((bits >> 16) & 1u);
        out[i] = (uint16_t)(bits >> 16);
    }
}

/* 4 horizontal sums at once: lane i of the result = sum of the 8 lanes of argument i. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

#endif
