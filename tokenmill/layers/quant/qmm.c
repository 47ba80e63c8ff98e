/* Quantized-weight matmuls for x86-64 AVX2 + FMA + F16C: y[M, N] = x[M, K] @ dequant(W)^T.
 *
 * Two paths. tm_qmm keeps activations float32: weights are expanded to fp32 in registers,
 * never in memory, and every product is accumulated in fp32, so results equal the
 * plain-PyTorch reference (dequantize, then F.linear) up to summation order. It is
 * compute-bound here (~2.6 G int4 weights/s per core). tm_qmm_q8 (end of file) rounds
 * activations to int8 per run of 32 and uses integer dot products: ~2.6x the int4 rate and
 * 1.8x the int8 rate, at a small accuracy cost (measured with `tokenmill eval ppl
 * --chunk-size 8`); matmul.py picks one (TOKENMILL_QMM_ACTIVATIONS=fp32|q8, fp32 default).
 * q8 matmuls of a weight with a tiled copy (made at load) take tm_qgemm_q8 instead
 * (qgemm.c, included at the end): the same arithmetic, several times faster.
 *
 * Formats (row n of W, group g of G consecutive input columns):
 *   i8:  w = scale[n, g] * q [+ min[n, g]], q int8; G may also be 16 (GGUF Q6_K's scales,
 *        no mins); mins: GGUF Q5_1 / Q5_K, 5-bit values 0..31 with an affine term
 *   i4:  w = scale[n, g] * q + min[n, g], q in 0..15, packed two per byte: in each run of
 *        32 values, byte j holds value j in its low nibble and value j + 16 in its high one
 *        (GGUF's Q4_0 / Q4_1 layout, so those tensors repack by copying bytes)
 *   f8:  w = scale[n, g] * e4m3(q),        q the raw float8_e4m3fn byte
 * Rows of x are processed MB at a time so each converted weight vector feeds MB FMAs.
 * kind | KIND_HALF (i8 / i4): scales and mins are float16 (a checkpoint's own fp16 values,
 * e.g. GGUF's): half the bytes of float32 scales, and the same results since float16 ->
 * float32 is exact. Their pointers are then typed float * but hold uint16 halves:
 * row_at / at below are the only accessors.
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
#define KIND_HALF 8

/* &p[i] and p[i] of a scale / min array, float32 or (kind & KIND_HALF) float16 */
INLINE const float *row_at(const float *p, int64_t i, int kind) {
    return (kind & KIND_HALF) ? (const float *)((const uint16_t *)p + i) : p + i;
}
INLINE float at(const float *p, int64_t i, int kind) {
    return (kind & KIND_HALF) ? _cvtsh_ss(((const uint16_t *)p)[i]) : p[i];
}

/* Four weight vectors (32 values) of one row at column k, expanded to fp32. */
INLINE void load32(const uint8_t *w, int64_t k, int kind, __m256 v[4]) {
    kind &= 7;
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
    const float fold = (kind & 7) == 2 ? 256.0f : 1.0f;   /* see load_f8 */
    for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        for (int m = 0; m < mb; m++)
            for (int c = 0; c < chains; c++) part[m][c] = _mm256_setzero_ps();
        if (G == 16) {   /* i8 only: a group is half a 32-value step, two vectors */
            const int64_t k = g * 16;
            v[0] = load_i8((const int8_t *)w + k);
            v[1] = load_i8((const int8_t *)w + k + 8);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < 2; j++)
                    part[m][j % chains] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(x + m * ldx + k + 8 * j), v[j], part[m][j % chains]);
        } else for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            load32(w, k, kind, v);
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < 4; j++)
                    part[m][j % chains] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(x + m * ldx + k + 8 * j), v[j], part[m][j % chains]);
        }
        __m256 s = _mm256_set1_ps(at(scale, g, kind) * fold);
        for (int m = 0; m < mb; m++) {
            __m256 p = part[m][0];
            for (int c = 1; c < chains; c++) p = _mm256_add_ps(p, part[m][c]);
            acc[m] = _mm256_fmadd_ps(s, p, acc[m]);
            if (mins) lin[m] += at(mins, g, kind) * xsum[m * ngroups + g];
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

/* kind: 0 = i8, 1 = i4, 2 = f8, each | KIND_HALF for float16 scales (i8 / i4). w points at
 * row 0; row n starts at w + n * row_bytes. */
void tm_qmm(const float *x, int64_t M, int64_t K, const uint8_t *w, const float *scale,
            const float *mins, int64_t G, int64_t N, int kind, float *y, int nthreads) {
    int64_t ngroups = K / G, row_bytes = (kind & 7) == 1 ? K / 2 : K;
    float *xsum = NULL;
    if (mins) {  /* per-group sums of x carry the affine (min) term */
        xsum = (float *)malloc(sizeof(float) * (size_t)(M * ngroups));
        group_sums(x, M, K, G, xsum);
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float out[MB];
        const uint8_t *wr = w + n * row_bytes;
        const float *sr = row_at(scale, n * ngroups, kind);
        const float *mr = mins ? row_at(mins, n * ngroups, kind) : NULL;
        switch (kind) {
            case 0: { ROWS(0) } break;
            case 1: { ROWS(1) } break;
            case KIND_HALF: { ROWS(KIND_HALF) } break;
            case KIND_HALF | 1: { ROWS(KIND_HALF | 1) } break;
            default: { ROWS(2) }
        }
    }
    free(xsum);
}

/* W -> float32 [N, K] (stored column order), for many-row (prefill) matmuls that go to the
 * BLAS GEMM: one pass, no temporaries. */
void tm_dequant(const uint8_t *w, const float *scale, const float *mins, int64_t G, int64_t N,
                int64_t K, int kind, float *out, int nthreads) {
    int64_t ngroups = K / G, row_bytes = (kind & 7) == 1 ? K / 2 : K;
    const float fold = (kind & 7) == 2 ? 256.0f : 1.0f;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        __m256 v[4];
        for (int64_t k = 0; k < K; k += 32) {
            load32(w + n * row_bytes, k, kind, v);
            for (int j = 0; j < 4; j++) {   /* the group of each 8 values (G may be 16) */
                int64_t g = n * ngroups + (k + 8 * j) / G;
                __m256 s = _mm256_set1_ps(at(scale, g, kind) * fold);
                __m256 m = _mm256_set1_ps(mins ? at(mins, g, kind) : 0.0f);
                _mm256_storeu_ps(out + n * K + k + 8 * j, _mm256_fmadd_ps(v[j], s, m));
            }
        }
    }
}

/* ---- integer dot products against int8-quantized activations (decode rows) ----------
 * x is quantized per run of 32 values to int8 with its own scale d = max|x| / 127 (the
 * Q8_0 scheme llama.cpp uses for its quantized matmuls); each 32-value product of weights
 * and activations is then one vpmaddubsw + vpmaddwd in exact integer arithmetic, about a
 * quarter of the instructions of expanding weights to fp32. The int4 affine term uses the
 * exact fp32 group sums of x. Only kinds 0 (i8) and 1 (i4) (| KIND_HALF), G a multiple of 32
 * (or 16 for i8). */
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

/* Sum of four u8 x s8 products per int32 lane. AVX-512 VNNI (built in where the CPU has
 * it, kernels.py) does it in one instruction; AVX2 needs two, with the same lanes: each
 * lane's four products are exact integers, so both give identical sums (no saturation:
 * |u| <= 128 and |s| <= 127 keep every int16 pair sum of vpmaddubsw below 2^15). */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

INLINE __m256i load_w32(const uint8_t *w, int64_t k, int kind) {
    if ((kind & 7) == 1) {   /* 16 bytes -> 32 values 0..15 in order (low nibbles first):
                                * the bytes in both lanes, the high lane shifted by 4 */
        __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + k / 2)));
        b = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
        return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
    }
    return _mm256_loadu_si256((const __m256i *)(w + k));
}

/* R weight rows (n .. n+R-1) against mb rows of quantized x: mb * R independent
 * accumulator chains, and each activation block loaded once feeds R rows. Every 32-value
 * block adds (integer dot) * (dx * scale) to its chain; the int4 affine term min * sum(x)
 * is added per group at the end. out[m * R + r]. */
INLINE void tile_q8_pg(const int8_t *qx, const float *dx, const int mb, const int R, int64_t K,
                       const uint8_t *w, int64_t row_bytes, const float *scale, const float *mins,
                       int64_t G, int kind, const float *xsum, float *out, const int64_t per_group) {
    const int64_t ngroups = K / G, nb = K / 32;
    const int i4 = (kind & 7) == 1;
    __m256 acc[4][4];
    float lin[4][4];
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < R; r++) { acc[m][r] = _mm256_setzero_ps(); lin[m][r] = 0.0f; }
    /* groups outside, their blocks inside: each row's scale is read once per group, no block
     * pays an integer division to find its group, and the int4 affine term accumulates in
     * R * mb independent chains instead of a serial loop per row at the end (microbench,
     * M = 1, 2 threads: int4 3072x576 130-144 -> 121-132 us, 24576x576 957-1115 -> 887-918 us) */
    int64_t b = 0;
    for (int64_t g = 0; g < ngroups; g++) {
        float sc[4];
        for (int r = 0; r < R; r++) sc[r] = at(scale, r * ngroups + g, kind);
        if (mins)   /* the affine term: independent chains, not a serial loop per row after */
            for (int r = 0; r < R; r++) {
                const float mn = at(mins, r * ngroups + g, kind);
                for (int m = 0; m < mb; m++) lin[m][r] += mn * xsum[m * ngroups + g];
            }
        for (int64_t bb = 0; bb < per_group; bb++, b++) {
            const int64_t k = b * 32;
            __m256i xv[4];
            for (int m = 0; m < mb; m++) xv[m] = _mm256_loadu_si256((const __m256i *)(qx + m * K + k));
            /* each 64-byte line of the next rows once, non-temporal like cpu_ops.c's GEMV
             * (SmolLM2 Q4_1 q8 decode, 5 process pairs: 62.0-71.6 -> 63.6-75.7 tok/s) */
            if ((k & (i4 ? 127 : 63)) == 0)
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(w + (r + R) * row_bytes + (i4 ? k / 2 : k)), _MM_HINT_NTA);
            for (int r = 0; r < R; r++) {
                __m256i wv = load_w32(w + r * row_bytes, k, kind);
                __m256i wu = i4 ? wv : _mm256_sign_epi8(wv, wv);   /* unsigned operand */
                for (int m = 0; m < mb; m++) {
                    __m256i x = i4 ? xv[m] : _mm256_sign_epi8(xv[m], wv);
                    __m256i dot = dot_u8s8(wu, x);
                    acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                                _mm256_set1_ps(sc[r] * dx[m * nb + b]), acc[m][r]);
                }
            }
        }
    }
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = hsum(acc[m][r]) + lin[m][r];
}

/* int8 weights with a scale per 16 values (GGUF Q6_K): each 32-value block's dot has
 * values 0..15 in int32 lanes 0-3 and 16..31 in lanes 4-7 (four bytes per lane, in
 * order), so one vector holding the two groups' scales applies both. */
INLINE void tile_q8_g16(const int8_t *qx, const float *dx, const int mb, const int R, int64_t K,
                        const uint8_t *w, int64_t row_bytes, const float *scale, int kind,
                        float *out) {
    const int64_t nb = K / 32, ngroups = K / 16;
    __m256 acc[4][4];
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k = b * 32;
        __m256i xv[4];
        for (int m = 0; m < mb; m++) xv[m] = _mm256_loadu_si256((const __m256i *)(qx + m * K + k));
        if ((k & 63) == 0)
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(w + (r + R) * row_bytes + k), _MM_HINT_NTA);
        for (int r = 0; r < R; r++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * row_bytes + k));
            __m256i wu = _mm256_sign_epi8(wv, wv);
            const __m256 sv = _mm256_set_m128(_mm_set1_ps(at(scale, r * ngroups + 2 * b + 1, kind)),
                                              _mm_set1_ps(at(scale, r * ngroups + 2 * b, kind)));
            for (int m = 0; m < mb; m++) {
                __m256i dot = dot_u8s8(wu, _mm256_sign_epi8(xv[m], wv));
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_mul_ps(sv, _mm256_set1_ps(dx[m * nb + b])), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = hsum(acc[m][r]);
}

/* GGUF's groups are one block (G = 32): that case gets its own copy with the inner loop gone. */
INLINE void tile_q8(const int8_t *qx, const float *dx, const int mb, const int R, int64_t K,
                    const uint8_t *w, int64_t row_bytes, const float *scale, const float *mins,
                    int64_t G, int kind, const float *xsum, float *out) {
    if (G == 16) tile_q8_g16(qx, dx, mb, R, K, w, row_bytes, scale, kind, out);
    else if (G == 32) tile_q8_pg(qx, dx, mb, R, K, w, row_bytes, scale, mins, 32, kind, xsum, out, 1);
    else tile_q8_pg(qx, dx, mb, R, K, w, row_bytes, scale, mins, G, kind, xsum, out, G / 32);
}

/* Rows of x four (then 2, 3 or 1) at a time against R weight rows; R * mb <= 8 chains. */
#define TILE_Q8(KIND, R)                                                                    \
    for (int64_t m0 = 0; m0 < M; m0 += MB) {                                                 \
        int mb = M - m0 < MB ? (int)(M - m0) : MB;                                          \
        const int8_t *q0 = qx + m0 * K;                                                     \
        const float *d0 = dx + m0 * nb, *xs = xsum ? xsum + m0 * ngroups : NULL;            \
        if (mb == 4) tile_q8(q0, d0, 4, R > 2 ? 2 : R, K, wr, row_bytes, sr, mr, G, KIND, xs, out); \
        else if (mb == 3) tile_q8(q0, d0, 3, R > 2 ? 2 : R, K, wr, row_bytes, sr, mr, G, KIND, xs, out); \
        else if (mb == 2) tile_q8(q0, d0, 2, R, K, wr, row_bytes, sr, mr, G, KIND, xs, out); \
        else tile_q8(q0, d0, 1, R, K, wr, row_bytes, sr, mr, G, KIND, xs, out);           \
        if (mb >= 3 && R > 2) {   /* the other two weight rows of the tile */              \
            tile_q8(q0, d0, mb, 2, K, wr + 2 * row_bytes, row_bytes, row_at(sr, 2 * ngroups, KIND), \
                    mr ? row_at(mr, 2 * ngroups, KIND) : NULL, G, KIND, xs, out + 2 * mb);  \
            for (int m = 0; m < mb; m++)                                                     \
                for (int r = 0; r < 4; r++)                                                  \
                    y[(m0 + m) * N + n + r] = out[r < 2 ? m * 2 + r : 2 * mb + m * 2 + r - 2]; \
        } else {                                                                             \
            const int rr = mb >= 3 && R > 2 ? 2 : R;                                        \
            for (int m = 0; m < mb; m++)                                                     \
                for (int r = 0; r < rr; r++) y[(m0 + m) * N + n + r] = out[m * rr + r];     \
        }                                                                                    \
    }

/* The inputs of both q8 kernels: x [M, K] rounded to int8 per run of 32 (qx, scales dx)
 * and, for weights with mins (affine), its exact float sums per group of G (xsum). */
typedef struct { int8_t *qx; float *dx, *xsum; } q8_input;

static void q8_free(q8_input *in) { free(in->qx); free(in->dx); free(in->xsum); }

/* Returns nonzero, with nothing left allocated, when a buffer could not be allocated. */
static int q8_prepare(const float *x, int64_t M, int64_t K, int64_t G, int affine, q8_input *in) {
    in->qx = (int8_t *)malloc((size_t)(M * K));
    in->dx = (float *)malloc(sizeof(float) * (size_t)(M * (K / 32)));
    in->xsum = affine ? (float *)malloc(sizeof(float) * (size_t)(M * (K / G))) : NULL;
    if (!in->qx || !in->dx || (affine && !in->xsum)) { q8_free(in); return 1; }
    tm_quantize_q8(x, M, K, in->qx, in->dx);
    if (affine) group_sums(x, M, K, G, in->xsum);
    return 0;
}

/* Returns nonzero when a buffer could not be allocated (y untouched). */
int tm_qmm_q8(const float *x, int64_t M, int64_t K, const uint8_t *w, const float *scale,
              const float *mins, int64_t G, int64_t N, int kind, float *y, int nthreads) {
    const int64_t ngroups = K / G, nb = K / 32, row_bytes = (kind & 7) == 1 ? K / 2 : K;
    q8_input in;
    if (q8_prepare(x, M, K, G, mins != NULL, &in)) return 1;
    const int8_t *qx = in.qx;
    const float *dx = in.dx, *xsum = in.xsum;
    const int64_t tiles = (N + 3) / 4;   /* four weight rows per task; the last may be short */
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        float out[4 * MB];
        const int64_t n = 4 * t;
        const uint8_t *wr = w + n * row_bytes;
        const float *sr = row_at(scale, n * ngroups, kind);
        const float *mr = mins ? row_at(mins, n * ngroups, kind) : NULL;
        if (N - n >= 4) {
            switch (kind) {
                case 0: { TILE_Q8(0, 4) } break;
                case 1: { TILE_Q8(1, 4) } break;
                case KIND_HALF: { TILE_Q8(KIND_HALF, 4) } break;
                default: { TILE_Q8(KIND_HALF | 1, 4) }
            }
        } else {
            for (int64_t n1 = n; n1 < N; n1++) {   /* one row at a time */
                const int64_t n = n1;
                const uint8_t *wr = w + n * row_bytes;
                const float *sr = row_at(scale, n * ngroups, kind);
                const float *mr = mins ? row_at(mins, n * ngroups, kind) : NULL;
                switch (kind) {
                    case 0: { TILE_Q8(0, 1) } break;
                    case 1: { TILE_Q8(1, 1) } break;
                    case KIND_HALF: { TILE_Q8(KIND_HALF, 1) } break;
                    default: { TILE_Q8(KIND_HALF | 1, 1) }
                }
            }
        }
    }
    q8_free(&in);
    return 0;
}

#include "qgemm.c"   /* the q8 GEMM on a row-interleaved layout (VNNI or AVX2) */
