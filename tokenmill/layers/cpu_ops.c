/* Fused float32 CPU kernels for the per-layer small ops of a decode step (AVX2 + FMA).
 *
 * In eager PyTorch a decode step of a 30-layer model issues ~60 tiny ops per layer, each
 * costing microseconds of dispatch: more than the attention math itself. These kernels do
 * one layer-op in one call:
 *   tm_rms_norm        optional residual add (in place) + RMSNorm
 *   tm_rope            neox-style rotary embedding of q and k, in place
 *   tm_silu_mul        silu(gate) * up of a fused [T, 2I] gate_up output
 *   tm_paged_attention causal attention of short query runs over the paged KV cache
 * Plain-PyTorch references live beside the callers (tokenmill/layers/cpu_ops.py) and the
 * tests compare the two.
 */
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

static inline float exp1(float x) {   /* scalar tail through the same polynomial */
    float buf[8] = {x, 0, 0, 0, 0, 0, 0, 0};
    _mm256_storeu_ps(buf, exp256(_mm256_loadu_ps(buf)));
    return buf[0];
}

/* ---- RMSNorm ------------------------------------------------------------------------- */
/* If residual != NULL: residual[t] += x[t] (the new residual stream, in place) and the norm
 * reads it; else the norm reads x. out[t] = v / sqrt(mean(v^2) + eps) * w. */
void tm_rms_norm(const float *x, float *residual, const float *w, float eps, int64_t T,
                 int64_t H, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const float *xi = x + t * H;
        float *v = residual ? residual + t * H : (float *)xi;
        float *o = out + t * H;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            __m256 a = _mm256_loadu_ps(xi + i);
            if (residual) { a = _mm256_add_ps(a, _mm256_loadu_ps(v + i)); _mm256_storeu_ps(v + i, a); }
            acc = _mm256_fmadd_ps(a, a, acc);
        }
        float ss = hsum256(acc);
        for (; i < H; i++) {
            float a = xi[i];
            if (residual) { a += v[i]; v[i] = a; }
            ss += a * a;
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= H; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                  _mm256_mul_ps(_mm256_loadu_ps(v + i), vinv)));
        for (; i < H; i++) o[i] = w[i] * (v[i] * inv);
    }
}

/* ---- rotary -------------------------------------------------------------------------- */
/* Neox layout: x[i], x[i + D/2] rotate together. x rows have `row_stride` floats between
 * tokens and D floats between heads; cos/sin tables are [P, D] indexed by positions. */
static void rope_rows(float *x, int64_t T, int64_t heads, int64_t D, int64_t row_stride,
                      const float *cos, const float *sin, const int64_t *pos) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * D;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
                __m256 ra = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
                __m256 rb = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(v + i, ra);
                _mm256_storeu_ps(v + half + i, rb);
            }
            for (; i < half; i++) {
                float a = v[i], b = v[half + i];
                v[i] = a * c[i] - b * s[i];
                v[half + i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

void tm_rope(float *q, float *k, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
             int64_t q_stride, int64_t k_stride, const float *cos, const float *sin,
             const int64_t *pos) {
    rope_rows(q, T, Hq, D, q_stride, cos, sin, pos);
    rope_rows(k, T, Hkv, D, k_stride, cos, sin, pos);
}

/* ---- silu(gate) * up ----------------------------------------------------------------- */
void tm_silu_mul(const float *x, int64_t T, int64_t I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 a = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, a))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(a, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* ---- paged attention of short query runs --------------------------------------------- */
static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum256(acc);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float w, const float *x, float *y, int64_t D) {
    const __m256 vw = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < D; i++) y[i] += w * x[i];
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

static inline void axpy_i8(float w, const int8_t *x, float *y, int64_t D) {
    const __m256 vw = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + i))));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vw, v, _mm256_loadu_ps(y + i)));
    }
    for (; i < D; i++) y[i] += w * (float)x[i];
}

/* One task = one request x one query head, all of that request's query tokens.
 * q [T, Hq, D] with q_stride floats between tokens, out [T, Hq, D] contiguous; caches
 * float32, or int8 with a float scale per slot per KV head (k_scale / v_scale non-NULL:
 * value = scale[block, offset, head] * int8); [num_blocks, bs, Hkv, D]; block_tables [B, bt_stride];
 * request b has query rows q_start[b] .. q_start[b] + q_len[b] - 1 at positions
 * seq_len[b] - q_len[b] + i, each attending to keys at positions <= its own and
 * > position - window (window <= 0: no window). Returns nonzero if a buffer could not be
 * allocated (out then undefined). */
int tm_paged_attention(const float *q, int64_t q_stride, int64_t Hq, int64_t D, const void *k_cache,
                       const void *v_cache, const float *k_scale, const float *v_scale,
                       int64_t bs, int64_t Hkv, const int64_t *block_tables,
                       int64_t bt_stride, int64_t B, const int64_t *q_start, const int64_t *q_len,
                       const int64_t *seq_len, float scale, int64_t window, float *out,
                       int nthreads) {
    const int64_t group = Hq / Hkv;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) if (seq_len[b] > max_len) max_len = seq_len[b];
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(max_len + 8));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < Hq; h++) {
                if (!scores) continue;
                const int64_t kvh = h / group, ctx = seq_len[b] - q_len[b];
                const int64_t *table = block_tables + b * bt_stride;
                for (int64_t i = 0; i < q_len[b]; i++) {
                    const int64_t row = q_start[b] + i, p = ctx + i;
                    const int64_t first = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                    const int64_t n = p - first + 1;
                    const float *qv = q + row * q_stride + h * D;
                    float m = -INFINITY;
                    for (int64_t j = 0; j < n; j++) {
                        const int64_t pos = first + j;
                        const int64_t slot = (table[pos / bs] * bs + pos % bs) * Hkv + kvh;
                        const float s = k_scale
                            ? dot_i8(qv, (const int8_t *)k_cache + slot * D, D) * (k_scale[slot] * scale)
                            : dot(qv, (const float *)k_cache + slot * D, D) * scale;
                        scores[j] = s;
                        if (s > m) m = s;
                    }
                    const __m256 vm = _mm256_set1_ps(m);
                    __m256 vsum = _mm256_setzero_ps();
                    int64_t j = 0;
                    for (; j + 8 <= n; j += 8) {
                        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vm));
                        _mm256_storeu_ps(scores + j, e);
                        vsum = _mm256_add_ps(vsum, e);
                    }
                    float sum = hsum256(vsum);
                    for (; j < n; j++) { scores[j] = exp1(scores[j] - m); sum += scores[j]; }
                    float *o = out + (row * Hq + h) * D;
                    memset(o, 0, sizeof(float) * (size_t)D);
                    for (j = 0; j < n; j++) {
                        const int64_t pos = first + j;
                        const int64_t slot = (table[pos / bs] * bs + pos % bs) * Hkv + kvh;
                        if (v_scale) axpy_i8(scores[j] * v_scale[slot], (const int8_t *)v_cache + slot * D, o, D);
                        else axpy(scores[j], (const float *)v_cache + slot * D, o, D);
                    }
                    const float inv = 1.0f / sum;
                    for (int64_t d = 0; d < D; d++) o[d] *= inv;
                }
            }
        }
        free(scores);
    }
    return failed;
}

/* ---- small-M float32 matmul: y[M, N] = x[M, K] W[N, K]^T (+ bias) ---------------------
 * Decode multiplies one (or a few) activation rows by every weight: pure weight streaming,
 * so the goal is reading W once at memory bandwidth. Each task takes 4 weight rows and runs
 * all M activation rows (kept in L1) against them; two accumulators per (row, x-row) pair
 * keep the FMA pipes busy, and the next rows are prefetched ahead of use. */
#define GEMV_MAX_M 4

static inline void gemv_rows4(const float *x, int64_t M, int64_t K, const float *w,
                              const float *bias, float *y, int64_t N, int64_t n0) {
    __m256 acc[GEMV_MAX_M][4];
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps();
    const float *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        _mm_prefetch((const char *)(w0 + k + 4 * K), _MM_HINT_T0);
        _mm_prefetch((const char *)(w2 + k + 4 * K), _MM_HINT_T0);
        __m256 a0 = _mm256_loadu_ps(w0 + k), a1 = _mm256_loadu_ps(w1 + k);
        __m256 a2 = _mm256_loadu_ps(w2 + k), a3 = _mm256_loadu_ps(w3 + k);
        for (int64_t m = 0; m < M; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(a0, xv, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(a1, xv, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(a2, xv, acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(a3, xv, acc[m][3]);
        }
    }
    for (int64_t m = 0; m < M; m++) {
        for (int r = 0; r < 4; r++) {
            const float *wr = w0 + r * K;
            float s = hsum256(acc[m][r]);
            for (int64_t kk = k; kk < K; kk++) s += wr[kk] * x[m * K + kk];
            y[m * N + n0 + r] = s + (bias ? bias[n0 + r] : 0.0f);
        }
    }
}

static inline void gemv_row1(const float *x, int64_t M, int64_t K, const float *w,
                             const float *bias, float *y, int64_t N, int64_t n) {
    for (int64_t m = 0; m < M; m++)
        y[m * N + n] = dot(x + m * K, w + n * K, K) + (bias ? bias[n] : 0.0f);
}

void tm_linear_small_m(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y, int nthreads) {
    int64_t n4 = N / 4;
    /* chunks of 16 rows per task: few enough scheduling points, many enough to balance */
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= (1 << 16))
    for (int64_t c = 0; c < (n4 + 3) / 4; c++) {
        for (int64_t b = c * 4; b < n4 && b < c * 4 + 4; b++)
            gemv_rows4(x, M, K, w, bias, y, N, b * 4);
    }
    for (int64_t n = n4 * 4; n < N; n++) gemv_row1(x, M, K, w, bias, y, N, n);
}
