/* Paged attention of short query runs (decode tokens, speculative runs) for the fused
 * CPU path: reads K/V straight from the paged cache through the block table, float32,
 * float16 / bfloat16 (half the bytes, widened in registers) or int8 with per-slot scales. Reference: tokenmill/layers/attention/reference.py; the tests
 * compare the two (tests/layers/test_cpu_ops.py). */
#include "cpu_simd.h"

#define ATT_MAX_G 8   /* query heads per KV head handled together (GQA group) */
#define ATT_PF 8      /* keys of look-ahead for software prefetch */
#define ATT_SPLIT_MIN 32   /* keys per thread before a row's keys are split across threads */

static inline void prefetch_bytes(const void *p, int64_t nbytes) {
    for (int64_t b = 0; b < nbytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Address of element `elem` of a cache of value type dt. */
static inline const void *kv_at(const void *cache, int64_t elem, int dt) {
    return (const char *)cache + elem * kv_elem_bytes(dt);
}

/* q . rows[r] + off for four key rows at once (D % 8 == 0), times scale: the block both
 * score loops use, so their arithmetic is one and the same. */
static inline __m128 dot4_scaled(const float *q, const void *const rows[4], int64_t off,
                                 int64_t D, float scale, int dt) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, kv_load8(rows[0], off + d, dt), a0);
        a1 = _mm256_fmadd_ps(x, kv_load8(rows[1], off + d, dt), a1);
        a2 = _mm256_fmadd_ps(x, kv_load8(rows[2], off + d, dt), a2);
        a3 = _mm256_fmadd_ps(x, kv_load8(rows[3], off + d, dt), a3);
    }
    return _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale));
}

/* o += w[0] rows[0][off:] + .. + w[3] rows[3][off:] over D values (D % 8 == 0), one
 * multiply-add at a time in row order: the same sums as four single-row updates, with o
 * loaded and stored once instead of four times. */
static inline void add4_scaled(float *o, const float w[4], const void *const rows[4],
                               int64_t off, int64_t D, int dt) {
    const __m256 w0 = _mm256_set1_ps(w[0]), w1 = _mm256_set1_ps(w[1]);
    const __m256 w2 = _mm256_set1_ps(w[2]), w3 = _mm256_set1_ps(w[3]);
    for (int64_t d = 0; d < D; d += 8) {
        __m256 acc = _mm256_loadu_ps(o + d);
        acc = _mm256_fmadd_ps(w0, kv_load8(rows[0], off + d, dt), acc);
        acc = _mm256_fmadd_ps(w1, kv_load8(rows[1], off + d, dt), acc);
        acc = _mm256_fmadd_ps(w2, kv_load8(rows[2], off + d, dt), acc);
        acc = _mm256_fmadd_ps(w3, kv_load8(rows[3], off + d, dt), acc);
        _mm256_storeu_ps(o + d, acc);
    }
}

/* Scores of G query heads (sharing one KV head) against n keys, float cache (f32 / f16 /
 * bf16: dt), D % 16 == 0. Each key row is loaded once for all G heads; four keys are
 * reduced together. */
static void scores_kv(const float *qv, int64_t G, int64_t D, const void *k_cache, int dt,
                      const int64_t *table, int64_t bs, int64_t Hkv, int64_t kvh,
                      int64_t first, int64_t n, float scale, float *scores /* [G][n] */) {
    const int64_t row_bytes = D * (dt == KV_F32 ? 4 : 2);
    int64_t blk = first / bs, off = first % bs;
    /* a second cursor ATT_PF keys ahead prefetches rows: keys of one head are strided by
     * Hkv * D values, a pattern the hardware prefetchers follow poorly */
    int64_t pf_pos = first, pf_blk = blk, pf_off = off;
    const int64_t pf_end = first + n;
    for (int k = 0; k < ATT_PF && pf_pos < pf_end; k++, pf_pos++)
        if (++pf_off == bs) { pf_off = 0; pf_blk++; }
    const void *rows[4];
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        for (int r = 0; r < 4; r++) {
            rows[r] = kv_at(k_cache, ((table[blk] * bs + off) * Hkv + kvh) * D, dt);
            if (++off == bs) { off = 0; blk++; }
            if (pf_pos < pf_end) {
                prefetch_bytes(kv_at(k_cache, ((table[pf_blk] * bs + pf_off) * Hkv + kvh) * D, dt),
                               row_bytes);
                pf_pos++;
                if (++pf_off == bs) { pf_off = 0; pf_blk++; }
            }
        }
        for (int64_t g = 0; g < G; g++)
            _mm_storeu_ps(scores + g * n + j, dot4_scaled(qv + g * D, rows, 0, D, scale, dt));
    }
    for (; j < n; j++) {
        const void *row = kv_at(k_cache, ((table[blk] * bs + off) * Hkv + kvh) * D, dt);
        if (++off == bs) { off = 0; blk++; }
        for (int64_t g = 0; g < G; g++) scores[g * n + j] = dot_kv(qv + g * D, row, D, dt) * scale;
    }
}

/* out_g = sum_j p[g][j] V_j for G heads, float cache (dt), D % 32 == 0: 32 output floats
 * per head stay in registers across all keys, each V chunk is loaded once for all heads. */
static void weighted_values_kv(const float *p, int64_t G, int64_t D, const void *v_cache, int dt,
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
                const void *row = kv_at(v_cache, ((table[blk] * bs + off) * Hkv + kvh) * D + d0, dt);
                if (++off == bs) { off = 0; blk++; }
                if (pf_pos < first + n) {
                    prefetch_bytes(kv_at(v_cache, ((table[pf_blk] * bs + pf_off) * Hkv + kvh) * D + d0, dt),
                                   32 * (dt == KV_F32 ? 4 : 2));
                    pf_pos++;
                    if (++pf_off == bs) { pf_off = 0; pf_blk++; }
                }
                __m256 v0 = kv_load8(row, 0, dt), v1 = kv_load8(row, 8, dt);
                __m256 v2 = kv_load8(row, 16, dt), v3 = kv_load8(row, 24, dt);
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

/* Softmax numerators of each of G score rows of length n in place: exp(s - max); writes
 * each row's max and sum of numerators. */
static void softmax_rows(float *scores, int64_t G, int64_t n, float *row_max, float *row_sum) {
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
        row_max[g] = m;
        row_sum[g] = sum;
    }
}

/* Attention of one query row for G consecutive query heads h0.. sharing KV head kvh, over
 * keys first .. first + n - 1. part_max == NULL: o = the normalized output. Otherwise a
 * partial result over this run of keys, for merging (attend_split): o = unnormalized
 * sum_j exp(s_j - max) v_j, part_max / part_sum = each head's max score and sum of exps. */
static void attend(const float *qv, int64_t G, int64_t D, const void *k_cache, const void *v_cache,
                   const float *k_scale, const float *v_scale, int dt, const int64_t *table,
                   int64_t bs, int64_t Hkv, int64_t kvh, int64_t first, int64_t n, float scale,
                   float *o, float *scores, float *part_max, float *part_sum) {
    float mx[ATT_MAX_G], sm[ATT_MAX_G];
    const int fast = dt != KV_I8 && D % 32 == 0;
    if (fast) {
        scores_kv(qv, G, D, k_cache, dt, table, bs, Hkv, kvh, first, n, scale, scores);
    } else {
        int64_t blk = first / bs, off = first % bs;
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = (table[blk] * bs + off) * Hkv + kvh;
            if (++off == bs) { off = 0; blk++; }
            for (int64_t g = 0; g < G; g++)
                scores[g * n + j] = dt == KV_I8
                    ? dot_i8(qv + g * D, (const int8_t *)k_cache + slot * D, D) * (k_scale[slot] * scale)
                    : dot_kv(qv + g * D, kv_at(k_cache, slot * D, dt), D, dt) * scale;
        }
    }
    softmax_rows(scores, G, n, mx, sm);
    if (fast) {
        weighted_values_kv(scores, G, D, v_cache, dt, table, bs, Hkv, kvh, first, n, o, D);
    } else {
        for (int64_t g = 0; g < G; g++) memset(o + g * D, 0, sizeof(float) * (size_t)D);
        int64_t blk = first / bs, off = first % bs;
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = (table[blk] * bs + off) * Hkv + kvh;
            if (++off == bs) { off = 0; blk++; }
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * n + j];
                axpy_kv(dt == KV_I8 ? p * v_scale[slot] : p, kv_at(v_cache, slot * D, dt),
                        o + g * D, D, dt);
            }
        }
    }
    if (part_max) {
        for (int64_t g = 0; g < G; g++) { part_max[g] = mx[g]; part_sum[g] = sm[g]; }
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.0f / sm[g];
        for (int64_t d = 0; d < D; d++) o[g * D + d] *= inv;
    }
}

/* Walks the keys first, first + 1, .. of a run through a block table, one slot row of
 * row_len values each, prefetching the row ATT_PF keys ahead while inside the run (the
 * loads wait on cache misses otherwise: each key's row is a new stretch of the cache). */
typedef struct { int64_t blk, off, pf, pf_blk, pf_off, end; } slot_walk;

static inline slot_walk walk_from(int64_t first, int64_t n, int64_t bs) {
    slot_walk w = {first / bs, first % bs, first, first / bs, first % bs, first + n};
    for (int k = 0; k < ATT_PF && w.pf < w.end; k++, w.pf++)
        if (++w.pf_off == bs) { w.pf_off = 0; w.pf_blk++; }
    return w;
}

/* The current key's row (a float cache of value type dt); steps to the next key. */
static inline const void *walk_next(slot_walk *w, const void *cache, const int64_t *table,
                                    int64_t bs, int64_t row_len, int dt) {
    const void *row = kv_at(cache, (table[w->blk] * bs + w->off) * row_len, dt);
    if (++w->off == bs) { w->off = 0; w->blk++; }
    if (w->pf < w->end) {
        prefetch_bytes(kv_at(cache, (table[w->pf_blk] * bs + w->pf_off) * row_len, dt),
                       row_len * kv_elem_bytes(dt));
        w->pf++;
        if (++w->pf_off == bs) { w->pf_off = 0; w->pf_blk++; }
    }
    return row;
}

/* All Hq query heads of one row over keys first .. first + n - 1, cache of value type dt
 * (int8 with per-slot scales k_scale / v_scale [slots, Hkv]), D % 32 == 0: each key's K
 * row and V row (every KV head, contiguous) are read once, in slot order, so a block is one
 * sequential stretch, instead of one strided pass per KV head. For float caches the
 * arithmetic per head is scores_kv's and weighted_values_kv's, in the same order, so the
 * result is bit-identical to attend(). scores [Hq][n], stats [2 Hq] (each head's max
 * score, then sum of exps), o [Hq][D]: normalized, or with ``partial`` the unnormalized
 * sums of a run for attend_split to merge. */
static inline __attribute__((always_inline)) void attend_heads_as(
        const float *qv, int64_t Hq, int64_t Hkv, int64_t D, const void *k_cache,
        const void *v_cache, const float *k_scale, const float *v_scale, int dt,
        const int64_t *table, int64_t bs, int64_t first, int64_t n, float scale, float *o,
        float *scores, float *stats, int partial) {
    const int64_t group = Hq / Hkv, row_len = Hkv * D;
    slot_walk keys = walk_from(first, n, bs);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const void *rows[4];
        int64_t slots[4];
        for (int r = 0; r < 4; r++) {
            rows[r] = walk_next(&keys, k_cache, table, bs, row_len, dt);
            slots[r] = ((const char *)rows[r] - (const char *)k_cache) / (row_len * kv_elem_bytes(dt));
        }
        for (int64_t h = 0; h < Hq; h++) {
            __m128 s4 = dot4_scaled(qv + h * D, rows, (h / group) * D, D, scale, dt);
            if (dt == KV_I8) {
                const int64_t kvh = h / group;
                s4 = _mm_mul_ps(s4, _mm_set_ps(k_scale[slots[3] * Hkv + kvh], k_scale[slots[2] * Hkv + kvh],
                                               k_scale[slots[1] * Hkv + kvh], k_scale[slots[0] * Hkv + kvh]));
            }
            _mm_storeu_ps(scores + h * n + j, s4);
        }
    }
    for (; j < n; j++) {
        const void *row = walk_next(&keys, k_cache, table, bs, row_len, dt);
        const int64_t slot = ((const char *)row - (const char *)k_cache) / (row_len * kv_elem_bytes(dt));
        for (int64_t h = 0; h < Hq; h++) {
            float s = dot_kv(qv + h * D, kv_at(row, (h / group) * D, dt), D, dt) * scale;
            scores[h * n + j] = dt == KV_I8 ? s * k_scale[slot * Hkv + h / group] : s;
        }
    }
    softmax_rows(scores, Hq, n, stats, stats + Hq);
    memset(o, 0, sizeof(float) * (size_t)(Hq * D));
    slot_walk values = walk_from(first, n, bs);
    /* four keys at a time (add4_scaled), then the rest one by one */
    for (j = 0; j + 4 <= n; j += 4) {
        const void *rows[4];
        int64_t slots[4];
        for (int r = 0; r < 4; r++) {
            rows[r] = walk_next(&values, v_cache, table, bs, row_len, dt);
            slots[r] = dt == KV_I8 ? ((const char *)rows[r] - (const char *)v_cache) / row_len : 0;
        }
        for (int64_t h = 0; h < Hq; h++) {
            const int64_t off = (h / group) * D;
            float w[4];
            for (int r = 0; r < 4; r++) {
                const float p = scores[h * n + j + r];
                w[r] = dt == KV_I8 ? p * v_scale[slots[r] * Hkv + h / group] : p;
            }
            add4_scaled(o + h * D, w, rows, off, D, dt);
        }
    }
    for (; j < n; j++) {
        const void *row = walk_next(&values, v_cache, table, bs, row_len, dt);
        const int64_t slot = dt == KV_I8 ? ((const char *)row - (const char *)v_cache) / row_len : 0;
        for (int64_t h = 0; h < Hq; h++) {
            const float p = scores[h * n + j];
            const __m256 w = _mm256_set1_ps(dt == KV_I8 ? p * v_scale[slot * Hkv + h / group] : p);
            const void *vh = kv_at(row, (h / group) * D, dt);
            float *oh = o + h * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(w, kv_load8(vh, d, dt), _mm256_loadu_ps(oh + d)));
        }
    }
    if (partial) return;
    for (int64_t h = 0; h < Hq; h++) {
        const float inv = 1.0f / stats[Hq + h];
        for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;
    }
}

/* attend_heads_as compiled once per value type (a constant dt: no per-load branch). */
static void attend_heads(const float *qv, int64_t Hq, int64_t Hkv, int64_t D,
                         const void *k_cache, const void *v_cache, const float *k_scale,
                         const float *v_scale, int dt, const int64_t *table, int64_t bs,
                         int64_t first, int64_t n, float scale, float *o, float *scores,
                         float *stats, int partial) {
#define ATTEND_HEADS_AS(DT) attend_heads_as(qv, Hq, Hkv, D, k_cache, v_cache, k_scale, v_scale, \
                                            DT, table, bs, first, n, scale, o, scores, stats, partial)
    switch (dt) {
    case KV_F16: ATTEND_HEADS_AS(KV_F16); break;
    case KV_BF16: ATTEND_HEADS_AS(KV_BF16); break;
    case KV_I8: ATTEND_HEADS_AS(KV_I8); break;
    default: ATTEND_HEADS_AS(KV_F32);
    }
#undef ATTEND_HEADS_AS
}

/* Few requests (fewer than 2 x threads; when D % 32 != 0, fewer KV heads in flight): one
 * query row's keys are split into nthreads runs, each task takes every head over its run
 * (D % 32 == 0: attend_heads, each run one sequential stretch of slot rows; else one pass
 * per KV head), and the partial results merge with the usual max rescaling. Returns
 * nonzero if out of memory. */
static int attend_split(const float *qv, int64_t Hq, int64_t D, const void *k_cache,
                        const void *v_cache, const float *k_scale, const float *v_scale, int dt,
                        const int64_t *table, int64_t bs, int64_t Hkv, int64_t first, int64_t n,
                        float scale, float *o, int nthreads) {
    const int64_t group = Hq / Hkv, S = nthreads;
    const int whole_rows = D % 32 == 0;
    float *part = (float *)malloc(sizeof(float) * (size_t)(S * Hq * (D + 2)));
    if (!part) return 1;
    float *pmax = part + S * Hq * D, *psum = pmax + S * Hq;
    int failed = 0;
    #pragma omp parallel for schedule(static, 1) num_threads(nthreads)
    for (int64_t s = 0; s < S; s++) {
        const int64_t lo = first + n * s / S, hi = first + n * (s + 1) / S;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(Hq * (hi - lo) + 2 * Hq + 8));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        if (hi == lo) {   /* an empty run adds nothing */
            for (int64_t h = 0; h < Hq; h++) { pmax[s * Hq + h] = -INFINITY; psum[s * Hq + h] = 0.0f; }
            memset(part + s * Hq * D, 0, sizeof(float) * (size_t)(Hq * D));
        } else if (whole_rows) {
            float *stats = scores + Hq * (hi - lo);
            attend_heads(qv, Hq, Hkv, D, k_cache, v_cache, k_scale, v_scale, dt, table, bs, lo,
                         hi - lo, scale, part + s * Hq * D, scores, stats, 1);
            memcpy(pmax + s * Hq, stats, sizeof(float) * (size_t)Hq);
            memcpy(psum + s * Hq, stats + Hq, sizeof(float) * (size_t)Hq);
        } else {
            for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                const int64_t h0 = kvh * group;
                attend(qv + h0 * D, group, D, k_cache, v_cache, k_scale, v_scale, dt, table, bs,
                       Hkv, kvh, lo, hi - lo, scale, part + (s * Hq + h0) * D, scores,
                       pmax + s * Hq + h0, psum + s * Hq + h0);
            }
        }
        free(scores);
    }
    if (!failed)
        for (int64_t h = 0; h < Hq; h++) {
            float m = -INFINITY, total = 0.0f, w[64];
            for (int64_t s = 0; s < S; s++) if (pmax[s * Hq + h] > m) m = pmax[s * Hq + h];
            for (int64_t s = 0; s < S; s++) {
                w[s] = psum[s * Hq + h] > 0.0f ? exp1(pmax[s * Hq + h] - m) : 0.0f;
                total += w[s] * psum[s * Hq + h];
            }
            const float inv = 1.0f / total;
            for (int64_t d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t s = 0; s < S; s++) acc += w[s] * part[(s * Hq + h) * D + d];
                o[h * D + d] = acc * inv;
            }
        }
    free(part);
    return failed;
}

/* The first key position a query at position p sees (window <= 0: no window). */
static inline int64_t window_first(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* One task = one request x a run of query heads: every head when requests alone keep every
 * thread busy (float caches: attend_heads), else the heads sharing a KV head (the
 * whole GQA group when there are enough tasks, else one head); all of that request's
 * query tokens.
 * q [T, Hq, D] with q_stride floats between tokens, out [T, Hq, D] contiguous; caches
 * [num_blocks, bs, Hkv, D] of dt: KV_F32, KV_F16, KV_BF16, or KV_I8 with a float scale per
 * slot per KV head (k_scale / v_scale: value = scale[block, offset, head] * int8);
 * block_tables [B, bt_stride];
 * request b has query rows q_start[b] .. q_start[b] + q_len[b] - 1 at positions
 * seq_len[b] - q_len[b] + i, each attending to keys at positions <= its own and
 * > position - window (window <= 0: no window). Returns nonzero if a buffer could not be
 * allocated (out then undefined). */
int tm_paged_attention(const float *q, int64_t q_stride, int64_t Hq, int64_t D, const void *k_cache,
                       const void *v_cache, const float *k_scale, const float *v_scale, int dt,
                       int64_t bs, int64_t Hkv, const int64_t *block_tables,
                       int64_t bt_stride, int64_t B, const int64_t *q_start, const int64_t *q_len,
                       const int64_t *seq_len, float scale, int64_t window, float *out,
                       int nthreads) {
    const int64_t group = Hq / Hkv;
    /* enough requests to keep every thread busy with whole requests: one task per request,
     * all heads at once (sequential cache reads). int8 caches always take it: their per-head
     * path (attend) rounds differently, and one request must not change numbers with the
     * batch it is in (the context split of few long rows aside) */
    const int all_heads = D % 32 == 0 && (B >= 2 * nthreads || dt == KV_I8);
    const int64_t G = all_heads ? Hq : (B * Hkv >= 2 * nthreads && group <= ATT_MAX_G) ? group : 1;
    const int64_t runs = Hq / G;   /* head runs per request */
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) if (seq_len[b] > max_len) max_len = seq_len[b];
    int failed = 0;
    /* tasks the batch offers without a split: one per request for whole-row reads (D % 32
     * == 0: attend_split reads every head at once), else one per request and KV head */
    const int64_t tasks = D % 32 == 0 ? B : B * Hkv;
    if (tasks < 2 * nthreads && nthreads > 1 && nthreads <= 64) {
        /* few requests: split each row's keys (the window's, if any) across the threads
         * (long enough rows) */
        int split_all = 1;
        for (int64_t b = 0; b < B; b++) {
            const int64_t keys = seq_len[b] - q_len[b] + 1;
            if ((window > 0 && window < keys ? window : keys) < ATT_SPLIT_MIN * nthreads) split_all = 0;
        }
        if (split_all) {
            for (int64_t b = 0; b < B && !failed; b++)
                for (int64_t i = 0; i < q_len[b] && !failed; i++) {
                    const int64_t row = q_start[b] + i, p = seq_len[b] - q_len[b] + i;
                    const int64_t first = window_first(p, window);
                    failed = attend_split(q + row * q_stride, Hq, D, k_cache, v_cache, k_scale,
                                          v_scale, dt, block_tables + b * bt_stride, bs, Hkv,
                                          first, p - first + 1, scale, out + row * Hq * D, nthreads);
                }
            return failed;
        }
    }
    #pragma omp parallel num_threads(nthreads) if (B * runs > 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_len + 2 * Hq + 8));
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
                    const int64_t first = window_first(p, window);
                    if (all_heads)
                        attend_heads(q + row * q_stride, Hq, Hkv, D, k_cache, v_cache, k_scale,
                                     v_scale, dt, table, bs, first, p - first + 1, scale,
                                     out + row * Hq * D, scores, scores + G * max_len, 0);
                    else
                        attend(q + row * q_stride + h0 * D, G, D, k_cache, v_cache, k_scale, v_scale,
                               dt, table, bs, Hkv, kvh, first, p - first + 1, scale,
                               out + (row * Hq + h0) * D, scores, NULL, NULL);
                }
            }
        }
        free(scores);
    }
    return failed;
}
