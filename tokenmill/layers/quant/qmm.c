/* Quantized-weight matmuls for x86-64 AVX2 + FMA + F16C: y[M, N] = x[M, K] @ dequant(W)^T.
 *
 * Activations stay float32 (on this CPU bf16 arithmetic is ~60x slower than fp32, and
 * quantizing activations costs accuracy); only the weights are compressed, which is what
 * a memory-bound decode step needs. Weights are expanded to fp32 in registers, never in
 * memory, and every product is accumulated in fp32, so results equal the plain-PyTorch
 * reference (dequantize, then F.linear) up to summation order.
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

/* One weight row against mb rows of x, int8 or fp8 values (kind 0 = i8, 2 = f8). */
static void row_8bit(const float *x, int64_t ldx, int mb, int64_t K, const uint8_t *w,
                     const float *scale, int64_t G, int kind, float *out) {
    __m256 acc[MB], part[MB];
    for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        for (int m = 0; m < mb; m++) part[m] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + G; k += 8) {
            __m256 wv = kind == 0 ? load_i8((const int8_t *)w + k) : load_f8(w + k);
            for (int m = 0; m < mb; m++)
                part[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, part[m]);
        }
        __m256 s = _mm256_set1_ps(scale[g0 / G] * (kind == 2 ? 256.0f : 1.0f));
        for (int m = 0; m < mb; m++) acc[m] = _mm256_fmadd_ps(s, part[m], acc[m]);
    }
    for (int m = 0; m < mb; m++) out[m] = hsum(acc[m]);
}

/* One int4 weight row against mb rows of x; xsum[m, g] = sum of x over group g. */
static void row_i4(const float *x, int64_t ldx, int mb, int64_t K, const uint8_t *qs,
                   const float *scale, const float *mins, int64_t G, const float *xsum,
                   int64_t ngroups, float *out) {
    __m256 acc[MB], part[MB];
    float lin[MB];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int m = 0; m < mb; m++) { acc[m] = _mm256_setzero_ps(); lin[m] = 0.0f; }
    for (int64_t g = 0; g < ngroups; g++) {
        for (int m = 0; m < mb; m++) part[m] = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            __m128i b = _mm_loadu_si128((const __m128i *)(qs + k / 2));
            __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            for (int m = 0; m < mb; m++) {
                const float *xp = x + m * ldx + k;
                __m256 p = _mm256_fmadd_ps(_mm256_loadu_ps(xp), w0, part[m]);
                p = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8), w1, p);
                p = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), w2, p);
                part[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), w3, p);
            }
        }
        __m256 s = _mm256_set1_ps(scale[g]);
        for (int m = 0; m < mb; m++) {
            acc[m] = _mm256_fmadd_ps(s, part[m], acc[m]);
            lin[m] += mins[g] * xsum[m * ngroups + g];
        }
    }
    for (int m = 0; m < mb; m++) out[m] = hsum(acc[m]) + lin[m];
}

/* kind: 0 = i8, 1 = i4, 2 = f8. w points at row 0; row n starts at w + n * row_bytes. */
void tm_qmm(const float *x, int64_t M, int64_t K, const uint8_t *w, const float *scale,
            const float *mins, int64_t G, int64_t N, int kind, float *y, int nthreads) {
    int64_t ngroups = K / G, row_bytes = kind == 1 ? K / 2 : K;
    float *xsum = NULL;
    if (kind == 1) {  /* per-group sums of x carry the affine (min) term of int4 */
        xsum = (float *)malloc(sizeof(float) * (size_t)(M * ngroups));
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < ngroups; g++) {
                float s = 0.0f;
                for (int64_t k = g * G; k < (g + 1) * G; k++) s += x[m * K + k];
                xsum[m * ngroups + g] = s;
            }
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float out[MB];
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? (int)(M - m0) : MB;
            if (kind == 1)
                row_i4(x + m0 * K, K, mb, K, w + n * row_bytes, scale + n * ngroups,
                       mins + n * ngroups, G, xsum + m0 * ngroups, ngroups, out);
            else
                row_8bit(x + m0 * K, K, mb, K, w + n * row_bytes, scale + n * ngroups, G,
                         kind, out);
            for (int m = 0; m < mb; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
    free(xsum);
}
