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
    /* two independent FMA chains: one chain is latency-bound at head size 64 */
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc2);
    }
    for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum256(_mm256_add_ps(acc, acc2));
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

/* 4 horizontal sums at once: lane i of the result = sum of the 8 lanes of argument i. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

#define ATT_MAX_G 8   /* query heads per KV head handled together (GQA group) */
#define ATT_PF 8      /* keys of look-ahead for software prefetch */

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char *)(row + d), _MM_HINT_T0);
}

/* Scores of G query heads (sharing one KV head) against n keys, float32 cache, D % 16 == 0.
 * Each key row is loaded once for all G heads; four keys are reduced together. */
static void scores_f32(const float *qv, int64_t G, int64_t D, const float *k_cache,
                       const int64_t *table, int64_t bs, int64_t Hkv, int64_t kvh,
                       int64_t first, int64_t n, float scale, float *scores /* [G][n] */) {
    int64_t blk = first / bs, off = first % bs;
    /* a second cursor ATT_PF keys ahead prefetches rows: keys of one head are strided by
     * Hkv * D floats, a pattern the hardware prefetchers follow poorly */
    int64_t pf_pos = first, pf_blk = blk, pf_off = off;
    const int64_t pf_end = first + n;
    for (int k = 0; k < ATT_PF && pf_pos < pf_end; k++, pf_pos++)
        if (++pf_off == bs) { pf_off = 0; pf_blk++; }
    const float *rows[4];
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        for (int r = 0; r < 4; r++) {
            rows[r] = k_cache + ((table[blk] * bs + off) * Hkv + kvh) * D;
            if (++off == bs) { off = 0; blk++; }
            if (pf_pos < pf_end) {
                prefetch_row(k_cache + ((table[pf_blk] * bs + pf_off) * Hkv + kvh) * D, D);
                pf_pos++;
                if (++pf_off == bs) { pf_off = 0; pf_blk++; }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qv + g * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                __m256 x = _mm256_loadu_ps(qg + d);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[0] + d), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[1] + d), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[2] + d), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[3] + d), a3);
            }
            _mm_storeu_ps(scores + g * n + j, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        }
    }
    for (; j < n; j++) {
        const float *row = k_cache + ((table[blk] * bs + off) * Hkv + kvh) * D;
        if (++off == bs) { off = 0; blk++; }
        for (int64_t g = 0; g < G; g++) scores[g * n + j] = dot(qv + g * D, row, D) * scale;
    }
}

/* out_g = sum_j p[g][j] V_j for G heads, float32 cache, D % 32 == 0: 32 output floats per
 * head stay in registers across all keys, each V chunk is loaded once for all heads. */
static void weighted_values_f32(const float *p, int64_t G, int64_t D, const float *v_cache,
                                const int64_t *table, int64_t bs, int64_t Hkv, int64_t kvh,
                                int64_t first, int64_t n, float *out, int64_t out_stride) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        for (int64_t g0 = 0; g0 < G; g0 += 2) {   /* two heads: 8 accumulators + 4 loads */
            const int64_t gn = G - g0 < 2 ? G - g0 : 2;
            __m256 acc[2][4];
            for (int g = 0; g < 2; g++) for (int c = 0; c < 4; c++) acc[g][c] = _mm256_setzero_ps();
            int64_t blk = first / bs, off = first % bs;
            int64_t pf_pos = first, pf_blk = blk, pf_off = off;
            for (int k = 0; k < ATT_PF && pf_pos < first + n; k++, pf_pos++)
                if (++pf_off == bs) { pf_off = 0; pf_blk++; }
            for (int64_t j = 0; j < n; j++) {
                const float *row = v_cache + ((table[blk] * bs + off) * Hkv + kvh) * D + d0;
                if (++off == bs) { off = 0; blk++; }
                if (pf_pos < first + n) {
                    const float *ahead = v_cache + ((table[pf_blk] * bs + pf_off) * Hkv + kvh) * D + d0;
                    _mm_prefetch((const char *)ahead, _MM_HINT_T0);
                    _mm_prefetch((const char *)(ahead + 16), _MM_HINT_T0);
                    pf_pos++;
                    if (++pf_off == bs) { pf_off = 0; pf_blk++; }
                }
                __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
                __m256 v2 = _mm256_loadu_ps(row + 16), v3 = _mm256_loadu_ps(row + 24);
                for (int64_t g = 0; g < gn; g++) {
                    __m256 w = _mm256_set1_ps(p[(g0 + g) * n + j]);
                    acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
                    acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
                    acc[g][2] = _mm256_fmadd_ps(w, v2, acc[g][2]);
                    acc[g][3] = _mm256_fmadd_ps(w, v3, acc[g][3]);
                }
            }
            for (int64_t g = 0; g < gn; g++)
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_ps(out + (g0 + g) * out_stride + d0 + 8 * c, acc[g][c]);
        }
    }
}

/* Softmax of each of G score rows of length n in place; returns nothing, writes 1/sum. */
static void softmax_rows(float *scores, int64_t G, int64_t n, float *inv_sum) {
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) if (s[j] > m) m = s[j];
        const __m256 vm = _mm256_set1_ps(m);
        __m256 vsum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
            _mm256_storeu_ps(s + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum256(vsum);
        for (; j < n; j++) { s[j] = exp1(s[j] - m); sum += s[j]; }
        inv_sum[g] = 1.0f / sum;
    }
}

/* Attention of one query row for G consecutive query heads h0.. sharing KV head kvh. */
static void attend(const float *qv, int64_t G, int64_t D, const void *k_cache, const void *v_cache,
                   const float *k_scale, const float *v_scale, const int64_t *table, int64_t bs,
                   int64_t Hkv, int64_t kvh, int64_t first, int64_t n, float scale, float *o,
                   float *scores) {
    float inv[ATT_MAX_G];
    const int fast = !k_scale && !v_scale && D % 32 == 0;
    if (fast) {
        scores_f32(qv, G, D, (const float *)k_cache, table, bs, Hkv, kvh, first, n, scale, scores);
    } else {
        int64_t blk = first / bs, off = first % bs;
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = (table[blk] * bs + off) * Hkv + kvh;
            if (++off == bs) { off = 0; blk++; }
            for (int64_t g = 0; g < G; g++)
                scores[g * n + j] = k_scale
                    ? dot_i8(qv + g * D, (const int8_t *)k_cache + slot * D, D) * (k_scale[slot] * scale)
                    : dot(qv + g * D, (const float *)k_cache + slot * D, D) * scale;
        }
    }
    softmax_rows(scores, G, n, inv);
    if (fast) {
        weighted_values_f32(scores, G, D, (const float *)v_cache, table, bs, Hkv, kvh, first, n, o, D);
    } else {
        for (int64_t g = 0; g < G; g++) memset(o + g * D, 0, sizeof(float) * (size_t)D);
        int64_t blk = first / bs, off = first % bs;
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = (table[blk] * bs + off) * Hkv + kvh;
            if (++off == bs) { off = 0; blk++; }
            for (int64_t g = 0; g < G; g++) {
                if (v_scale) axpy_i8(scores[g * n + j] * v_scale[slot], (const int8_t *)v_cache + slot * D, o + g * D, D);
                else axpy(scores[g * n + j], (const float *)v_cache + slot * D, o + g * D, D);
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) o[g * D + d] *= inv[g];
}

/* One task = one request x a run of query heads sharing a KV head (the whole GQA group
 * when there are enough tasks to keep every thread busy, else one head), all of that
 * request's query tokens.
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
    const int64_t G = (B * Hkv >= 2 * nthreads && group <= ATT_MAX_G) ? group : 1;
    const int64_t runs = Hq / G;   /* head runs per request */
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) if (seq_len[b] > max_len) max_len = seq_len[b];
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (B * runs > 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_len + 8));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t r = 0; r < runs; r++) {
                if (!scores) continue;
                const int64_t h0 = r * G, kvh = h0 / group, ctx = seq_len[b] - q_len[b];
                const int64_t *table = block_tables + b * bt_stride;
                for (int64_t i = 0; i < q_len[b]; i++) {
                    const int64_t row = q_start[b] + i, p = ctx + i;
                    const int64_t first = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                    attend(q + row * q_stride + h0 * D, G, D, k_cache, v_cache, k_scale, v_scale,
                           table, bs, Hkv, kvh, first, p - first + 1, scale,
                           out + (row * Hq + h0) * D, scores);
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
