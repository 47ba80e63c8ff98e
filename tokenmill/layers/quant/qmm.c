/* Quantized-weight matmuls for x86-64 AVX2 + FMA + F16C: y[M, N] = x[M, K] @ dequant(W)^T.
 *
 * Two paths. tm_qmm keeps activations float32: weights are expanded to fp32 in registers,
 * never in memory, and every product is accumulated in fp32, so results equal the
 * plain-PyTorch reference (dequantize, then F.linear) up to summation order. It is
 * compute-bound here (~2.6 G int4 weights/s per core). tm_qmm_q8 (end of file) rounds
 * activations to int8 per run of 32 and uses integer dot products: ~2.6x the int4 rate and
 * 1.8x the int8 rate, at a small accuracy cost (measured with `tokenmill eval ppl
 * --chunk-size 8`); matmul.py picks one (TOKENMILL_QMM_ACTIVATIONS=fp32|q8, fp32 default).
 *
 * Formats (row n of W, group g of G consecutive input columns):
 *   i8:  w = scale[n, g] * q,             q int8
 *   i4:  w = scale[n, g] * q + min[n, g], q in 0..15, packed two per byte: in each run of
 *        32 values, byte j holds value j in its low nibble and value j + 16 in its high one
 *        (GGUF's Q4_0 / Q4_1 layout, so those tensors repack by copying bytes)
 *   f8:  w = scale[n, g] * e4m3(q),        q the raw float8_e4m3fn byte
 * Rows of x are processed MB at a time so each converted weight vector feeds MB FMAs.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MB 4

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* e4m3 byte -> fp16 bits: shift exponent+mantissa into place (this also maps e4m3
 * subnormals onto exact fp16 values); the result is 2^-8 times the e4m3 value, so callers
 * multiply the scale by 256. */
static inline __m256 load_f8(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(mag, sign));
}

#define INLINE static inline __attribute__((always_inline))

/* Four weight vectors (32 values) of one row at column k, expanded to fp32. */
INLINE void load32(const uint8_t *w, int64_t k, int kind, __m256 v[4]) {
    if (kind == 1) {   /* int4: 16 bytes, low nibbles = values 0..15, high = 16..31 */
        const __m128i low = _mm_set1_epi8(0x0F);
        __m128i b = _mm_loadu_si128((const __m128i *)(w + k / 2));
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        for (int j = 0; j < 4; j++)
            v[j] = kind == 0 ? load_i8((const int8_t *)w + k + 8 * j) : load_f8(w + k + 8 * j);
    }
}

/* One weight row against mb (a compile-time 1, 2 or 4) rows of x. The four products of a
 * 32-value step go to 4/mb independent chains per row so that FMA latency, not only
 * throughput, is hidden when mb is small. xsum / mins: the int4 affine term. */
INLINE void row_dot(const float *x, int64_t ldx, const int mb, int64_t K, const uint8_t *w,
                    const float *scale, const float *mins, int64_t G, int kind,
                    const float *xsum, float *out) {
    const int chains = 4 / mb;
    const int64_t ngroups = K / G;
    __m256 acc[4], part[4][4], v[4];
    float lin[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const float fold = kind == 2 ? 256.0f : 1.0f;   /* see load_f8 */
    for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        for (int m = 0; m < mb; m++)
            for (int c = 0; c < chains; c++) part[m][c] = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            load32(w, k, kind, v);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < 4; j++)
                    part[m][j % chains] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(x + m * ldx + k + 8 * j), v[j], part[m][j % chains]);
        }
        __m256 s = _mm256_set1_ps(scale[g] * fold);
        for (int m = 0; m < mb; m++) {
            __m256 p = part[m][0];
            for (int c = 1; c < chains; c++) p = _mm256_add_ps(p, part[m][c]);
            acc[m] = _mm256_fmadd_ps(s, p, acc[m]);
            if (kind == 1) lin[m] += mins[g] * xsum[m * ngroups + g];
        }
    }
    for (int m = 0; m < mb; m++) out[m] = hsum(acc[m]) + lin[m];
}

/* xsum[m, g] = sum of x[m] over group g (G consecutive columns). */
static void group_sums(const float *x, int64_t M, int64_t K, int64_t G, float *xsum) {
    const int64_t ngroups = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ngroups; g++) {
            float s = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += x[m * K + k];
            xsum[m * ngroups + g] = s;
        }
}

/* The kind switch sits outside the row loop so each instance is specialised. */
#define ROWS(KIND)                                                                          \
    for (int64_t m0 = 0; m0 < M; m0 += MB) {                                                 \
        int mb = M - m0 < MB ? (int)(M - m0) : MB;                                          \
        const float *xm = x + m0 * K, *xs = xsum ? xsum + m0 * ngroups : NULL;              \
        if (mb == 4) row_dot(xm, K, 4, K, wr, sr, mr, G, KIND, xs, out);                    \
        else if (mb >= 2) { row_dot(xm, K, 2, K, wr, sr, mr, G, KIND, xs, out);             \
            if (mb == 3) row_dot(xm + 2 * K, K, 1, K, wr, sr, mr, G, KIND,                   \
                                 xs ? xs + 2 * ngroups : NULL, out + 2); }                  \
        else row_dot(xm, K, 1, K, wr, sr, mr, G, KIND, xs, out);                            \
        for (int m = 0; m < mb; m++) y[(m0 + m) * N + n] = out[m];                           \
    }

/* kind: 0 = i8, 1 = i4, 2 = f8. w points at row 0; row n starts at w + n * row_bytes. */
void tm_qmm(const float *x, int64_t M, int64_t K, const uint8_t *w, const float *scale,
            const float *mins, int64_t G, int64_t N, int kind, float *y, int nthreads) {
    int64_t ngroups = K / G, row_bytes = kind == 1 ? K / 2 : K;
    float *xsum = NULL;
    if (kind == 1) {  /* per-group sums of x carry the affine (min) term of int4 */
        xsum = (float *)malloc(sizeof(float) * (size_t)(M * ngroups));
        group_sums(x, M, K, G, xsum);
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float out[MB];
        const uint8_t *wr = w + n * row_bytes;
        const float *sr = scale + n * ngroups, *mr = mins ? mins + n * ngroups : NULL;
        if (kind == 0) { ROWS(0) } else if (kind == 1) { ROWS(1) } else { ROWS(2) }
    }
    free(xsum);
}

/* W -> float32 [N, K] (stored column order), for many-row (prefill) matmuls that go to the
 * BLAS GEMM: one pass, no temporaries. */
void tm_dequant(const uint8_t *w, const float *scale, const float *mins, int64_t G, int64_t N,
                int64_t K, int kind, float *out, int nthreads) {
    int64_t ngroups = K / G, row_bytes = kind == 1 ? K / 2 : K;
    const float fold = kind == 2 ? 256.0f : 1.0f;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        __m256 v[4];
        for (int64_t k = 0; k < K; k += 32) {
            int64_t g = n * ngroups + k / G;
            __m256 s = _mm256_set1_ps(scale[g] * fold);
            __m256 m = _mm256_set1_ps(kind == 1 ? mins[g] : 0.0f);
            load32(w + n * row_bytes, k, kind, v);
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(out + n * K + k + 8 * j, _mm256_fmadd_ps(v[j], s, m));
        }
    }
}

/* ---- integer dot products against int8-quantized activations (decode rows) ----------
 * x is quantized per run of 32 values to int8 with its own scale d = max|x| / 127 (the
 * Q8_0 scheme llama.cpp uses for its quantized matmuls); each 32-value product of weights
 * and activations is then one vpmaddubsw + vpmaddwd in exact integer arithmetic, about a
 * quarter of the instructions of expanding weights to fp32. The int4 affine term uses the
 * exact fp32 group sums of x. Only kinds 0 (i8) and 1 (i4), G a multiple of 32. */
void tm_quantize_q8(const float *x, int64_t M, int64_t K, int8_t *qx, float *dx) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 32; b++) {
            const float *v = x + m * K + b * 32;
            __m256 amax = _mm256_setzero_ps();
            const __m256 signbit = _mm256_set1_ps(-0.0f);
            for (int j = 0; j < 4; j++)
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(signbit, _mm256_loadu_ps(v + 8 * j)));
            __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            a = _mm_max_ps(a, _mm_movehl_ps(a, a));
            a = _mm_max_ss(a, _mm_movehdup_ps(a));
            const float d = _mm_cvtss_f32(a) / 127.0f;
            dx[m * (K / 32) + b] = d;
            const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), id));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), id));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), id));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), id));
            /* packs interleave 128-bit lanes; the permute restores value order */
            __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
            __m256i p = _mm256_packs_epi16(p01, p23);
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qx + m * K + b * 32), p);
        }
}

INLINE __m256i load_w32(const uint8_t *w, int64_t k, int kind) {
    if (kind == 1) {   /* 16 bytes -> 32 values 0..15 in order (low nibbles first) */
        __m128i b = _mm_loadu_si128((const __m128i *)(w + k / 2));
        const __m128i low = _mm_set1_epi8(0x0F);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    }
    return _mm256_loadu_si256((const __m256i *)(w + k));
}

INLINE void row_dot_q8(const int8_t *qx, const float *dx, const int mb, int64_t K,
                       const uint8_t *w, const float *scale, const float *mins, int64_t G,
                       int kind, const float *xsum, float *out) {
    const int64_t ngroups = K / G, nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    float lin[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        __m256 part[4];
        for (int m = 0; m < mb; m++) part[m] = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            __m256i wv = load_w32(w, k, kind);
            __m256i wu = kind == 1 ? wv : _mm256_sign_epi8(wv, wv);   /* unsigned operand */
            for (int m = 0; m < mb; m++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + m * K + k));
                if (kind != 1) xv = _mm256_sign_epi8(xv, wv);
                __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
                part[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                          _mm256_set1_ps(dx[m * nb + k / 32]), part[m]);
            }
        }
        __m256 s = _mm256_set1_ps(scale[g]);
        for (int m = 0; m < mb; m++) {
            acc[m] = _mm256_fmadd_ps(s, part[m], acc[m]);
            if (kind == 1) lin[m] += mins[g] * xsum[m * ngroups + g];
        }
    }
    for (int m = 0; m < mb; m++) out[m] = hsum(acc[m]) + lin[m];
}

#define ROWS_Q8(KIND)                                                                       \
    for (int64_t m0 = 0; m0 < M; m0 += MB) {                                                 \
        int mb = M - m0 < MB ? (int)(M - m0) : MB;                                          \
        const int8_t *q0 = qx + m0 * K;                                                     \
        const float *d0 = dx + m0 * nb, *xs = xsum ? xsum + m0 * ngroups : NULL;            \
        if (mb == 4) row_dot_q8(q0, d0, 4, K, wr, sr, mr, G, KIND, xs, out);                \
        else if (mb == 3) row_dot_q8(q0, d0, 3, K, wr, sr, mr, G, KIND, xs, out);           \
        else if (mb == 2) row_dot_q8(q0, d0, 2, K, wr, sr, mr, G, KIND, xs, out);           \
        else row_dot_q8(q0, d0, 1, K, wr, sr, mr, G, KIND, xs, out);                        \
        for (int m = 0; m < mb; m++) y[(m0 + m) * N + n] = out[m];                           \
    }

/* Returns nonzero when a buffer could not be allocated (y untouched). */
int tm_qmm_q8(const float *x, int64_t M, int64_t K, const uint8_t *w, const float *scale,
              const float *mins, int64_t G, int64_t N, int kind, float *y, int nthreads) {
    const int64_t ngroups = K / G, nb = K / 32, row_bytes = kind == 1 ? K / 2 : K;
    int8_t *qx = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xsum = kind == 1 ? (float *)malloc(sizeof(float) * (size_t)(M * ngroups)) : NULL;
    if (!qx || !dx || (kind == 1 && !xsum)) { free(qx); free(dx); free(xsum); return 1; }
    tm_quantize_q8(x, M, K, qx, dx);
    if (kind == 1) group_sums(x, M, K, G, xsum);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float out[MB];
        const uint8_t *wr = w + n * row_bytes;
        const float *sr = scale + n * ngroups, *mr = mins ? mins + n * ngroups : NULL;
        if (kind == 0) { ROWS_Q8(0) } else { ROWS_Q8(1) }
    }
    free(qx); free(dx); free(xsum);
    return 0;
}
