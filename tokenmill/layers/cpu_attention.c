/* Paged attention of short query runs (decode tokens, speculative runs and draft trees)
 * for the fused CPU path: reads K/V straight from the paged cache through the block table,
 * float32, float16 / bfloat16 (half the bytes, widened in registers) or int8 with per-slot
 * scales. Reference: tokenmill/layers/attention/reference.py; the tests compare the two
 * (tests/layers/test_cpu_ops.py, test_tree_attention.py). */
#include "cpu_simd.h"

#define ATT_MAX_G 8   /* query heads per KV head handled together (GQA group) */
#define ATT_PF 8      /* keys of look-ahead for software prefetch (one head's rows) */
#define ATT_PF_BYTES 6144   /* bytes of look-ahead for whole slot rows (attend_heads): 8 keys
                             * of SmolLM2's fp32 rows (3 KV heads x 64), 16 of fp16 */
#define ATT_SPLIT_MIN 32   /* keys per thread before a row's keys are split across threads */

/* Into L2 (T1), not L1: a key row is many lines, and L1's few miss buffers capped the
 * stream at ~13 GB/s on two Zen 4 threads whatever the look-ahead; through L2 the same
 * reads ran at 23-27 GB/s. */
static inline void prefetch_bytes(const void *p, int64_t nbytes) {
    for (int64_t b = 0; b < nbytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}

/* The lines of the look-ahead rows' segment that one compute loop (attend_heads: one KV
 * head's part of four key rows) prefetches, a few per iteration rather than all at once:
 * a burst of prefetches waits for fill buffers while the rows' arithmetic waits behind it,
 * so reading and computing took turns (a 2-core Xeon, SmolLM2's heads: K/V at 11-15 GB/s
 * with a key row's prefetch at once, 13-18 spread, docs/bench/2026-12-07f). row[r] NULL:
 * none. */
typedef struct { const char *row[4]; int64_t seg, lines; } pf_spread;

/* The rows ahead for the KV head kvh's loop (each row's D values from kvh * D), or NULL
 * where an earlier run of that head's query heads (`first` false) already prefetched them. */
static inline const pf_spread *pf_head(pf_spread *p, int64_t kvh, int64_t D, int dt, int first) {
    p->seg = kvh * D * kv_elem_bytes(dt);
    return first ? p : NULL;
}

/* Lines a loop of `steps` iterations prefetches per iteration: ceil(4 rows' lines / steps). */
static inline int64_t pf_per(const pf_spread *p, int64_t steps) {
    return p ? (4 * p->lines + steps - 1) / steps : 0;
}

/* Prefetch the share of iteration `it` (per: pf_per): line i is row i % 4's line i / 4. */
static inline __attribute__((always_inline)) void pf_share(const pf_spread *p, int64_t it,
                                                           int64_t per) {
    if (!p) return;
    for (int64_t i = it * per; i < (it + 1) * per && i < 4 * p->lines; i++)
        if (p->row[i & 3]) _mm_prefetch(p->row[i & 3] + p->seg + (i >> 2) * 64, _MM_HINT_T1);
}

/* Address of element `elem` of a cache of value type dt. */
static inline const void *kv_at(const void *cache, int64_t elem, int dt) {
    return (const char *)cache + elem * kv_elem_bytes(dt);
}

/* A draft tree's leaf alternative sits at position p, the position of the chain node it
 * replaces, but its own K/V were written to the slot of its index position in the run:
 * every key of its row is read through the block table as usual except the one at p, read
 * from slot `to` instead of slot `from` (slots: block * bs + offset). The swap is by slot,
 * not by key index, so each key keeps its index and code path (4-key groups, tail, split
 * runs) and the row's bits are those of a row at p whose cache held the alternative
 * there; a slot names one position of a request, so no other key of the row matches.
 * from = -1 (NO_SWAP): an ordinary row, one compare per key. */
typedef struct { int64_t from, to; } key_swap;
static const key_swap NO_SWAP = {-1, -1};

/* The slot of the key at block-table entry blk, offset off, after the row's swap. */
static inline int64_t key_slot(const int64_t *table, int64_t blk, int64_t off, int64_t bs,
                               key_swap sw) {
    const int64_t slot = table[blk] * bs + off;
    return slot == sw.from ? sw.to : slot;
}

/* Query heads that share each K / V chunk load in attend_heads: their accumulators, their q
 * chunks and one key chunk stay in registers (AVX-512VL has 32 vector registers; AVX2's 16
 * hold three heads: 12 accumulators, 3 q chunks, 1 key chunk, so a GQA group of three, as
 * SmolLM2's, is one run that widens each key chunk once). */
#ifdef __AVX512F__
#define ATT_HB 4
#else
#define ATT_HB 3
#endif

/* q_h . rows[r] + off for four key rows and hb query heads at once (q rows D apart, one KV
 * head at `off` in each key row, D % 8 == 0), times scale: out[h] lane r. Each key chunk is
 * loaded once for all heads; each head's sums are the same whatever hb, so both score loops
 * (scores_kv one head at a time, attend_heads a run of heads) give the same bits. pf: the
 * look-ahead rows this pass prefetches, or NULL. */
static inline __attribute__((always_inline)) void
dot4_heads(const float *q, int64_t D, const int hb, const void *const rows[4], int64_t off,
           float scale, int dt, __m128 *out, const pf_spread *pf) {
    __m256 acc[ATT_HB][4];
    for (int h = 0; h < hb; h++)
        for (int r = 0; r < 4; r++) acc[h][r] = _mm256_setzero_ps();
    const int64_t per = pf_per(pf, D / 8);
    for (int64_t d = 0; d < D; d += 8) {
        pf_share(pf, d / 8, per);
        __m256 x[ATT_HB];
        for (int h = 0; h < hb; h++) x[h] = _mm256_loadu_ps(q + h * D + d);
        for (int r = 0; r < 4; r++) {
            const __m256 k = kv_load8(rows[r], off + d, dt);
            for (int h = 0; h < hb; h++) acc[h][r] = _mm256_fmadd_ps(x[h], k, acc[h][r]);
        }
    }
    for (int h = 0; h < hb; h++)
        out[h] = _mm_mul_ps(hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), _mm_set1_ps(scale));
}

/* o_h += w[h][0] rows[0][off:] + .. + w[h][3] rows[3][off:] over D values (D % 8 == 0) for
 * hb heads (o rows D apart), one multiply-add at a time in row order: the same sums as four
 * single-row updates, each value chunk loaded once for all heads and o loaded and stored
 * once per four keys (elementwise, so the AVX-512 build's 16-wide chunks give the same
 * bits). */
static inline __attribute__((always_inline)) void
add4_heads(float *o, int64_t D, const int hb, const float w[][4], const void *const rows[4],
           int64_t off, int dt, const pf_spread *pf) {
    int64_t d = 0;
#ifdef __AVX512F__
    const int64_t per = pf_per(pf, D / 16);
    for (; d + 16 <= D; d += 16) {
        pf_share(pf, d / 16, per);
        __m512 v[4];
        for (int r = 0; r < 4; r++) v[r] = kv_load16(rows[r], off + d, dt);
        for (int h = 0; h < hb; h++) {
            __m512 acc = _mm512_loadu_ps(o + h * D + d);
            for (int r = 0; r < 4; r++) acc = _mm512_fmadd_ps(_mm512_set1_ps(w[h][r]), v[r], acc);
            _mm512_storeu_ps(o + h * D + d, acc);
        }
    }
#else
    const int64_t per = pf_per(pf, D / 8);
#endif
    for (; d < D; d += 8) {
#ifndef __AVX512F__
        pf_share(pf, d / 8, per);
#endif
        __m256 v[4];
        for (int r = 0; r < 4; r++) v[r] = kv_load8(rows[r], off + d, dt);
        for (int h = 0; h < hb; h++) {
            __m256 acc = _mm256_loadu_ps(o + h * D + d);
            for (int r = 0; r < 4; r++) acc = _mm256_fmadd_ps(_mm256_set1_ps(w[h][r]), v[r], acc);
            _mm256_storeu_ps(o + h * D + d, acc);
        }
    }
}

/* Scores of G query heads (sharing one KV head) against n keys, float cache (f32 / f16 /
 * bf16: dt), D % 16 == 0. Each key row is loaded once for all G heads; four keys are
 * reduced together. */
static void scores_kv(const float *qv, int64_t G, int64_t D, const void *k_cache, int dt,
                      const int64_t *table, int64_t bs, int64_t Hkv, int64_t kvh, key_swap sw,
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
            rows[r] = kv_at(k_cache, (key_slot(table, blk, off, bs, sw) * Hkv + kvh) * D, dt);
            if (++off == bs) { off = 0; blk++; }
            if (pf_pos < pf_end) {
                prefetch_bytes(kv_at(k_cache, ((table[pf_blk] * bs + pf_off) * Hkv + kvh) * D, dt),
                               row_bytes);
                pf_pos++;
                if (++pf_off == bs) { pf_off = 0; pf_blk++; }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            __m128 s4;
            dot4_heads(qv + g * D, D, 1, rows, 0, scale, dt, &s4, NULL);
            _mm_storeu_ps(scores + g * n + j, s4);
        }
    }
    for (; j < n; j++) {
        const void *row = kv_at(k_cache, (key_slot(table, blk, off, bs, sw) * Hkv + kvh) * D, dt);
        if (++off == bs) { off = 0; blk++; }
        for (int64_t g = 0; g < G; g++) scores[g * n + j] = dot_kv(qv + g * D, row, D, dt) * scale;
    }
}

/* out_g = sum_j p[g][j] V_j for G heads, float cache (dt), D % 32 == 0: 32 output floats
 * per head stay in registers across all keys, each V chunk is loaded once for all heads. */
static void weighted_values_kv(const float *p, int64_t G, int64_t D, const void *v_cache, int dt,
                               const int64_t *table, int64_t bs, int64_t Hkv, int64_t kvh,
                               key_swap sw, int64_t first, int64_t n, float *out,
                               int64_t out_stride) {
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
                const int64_t slot = key_slot(table, blk, off, bs, sw);
                const void *row = kv_at(v_cache, (slot * Hkv + kvh) * D + d0, dt);
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

/* The largest of s[0..n), NaNs skipped (-inf for none), as the scalar loop
 * `if (s[j] > m) m = s[j]` finds it; in vectors with independent running maxima, since a
 * one-at-a-time max waits on the previous compare (a long row's scores are thousands). A
 * max is exact, so the lanes' order changes nothing but which of +0 / -0 wins a tie, and
 * s - m and exp(s - m) are the same for both. */
static inline float max_of(const float *s, int64_t n) {
    int64_t j = 0;
    __m256 m8 = _mm256_set1_ps(-INFINITY);
#ifdef __AVX512F__
    if (n >= 64) {   /* four running maxima of 16 (x first: max_ps returns acc for a NaN x) */
        __m512 a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm512_set1_ps(-INFINITY);
        for (; j + 64 <= n; j += 64)
            for (int i = 0; i < 4; i++) a[i] = _mm512_max_ps(_mm512_loadu_ps(s + j + 16 * i), a[i]);
        const __m512 m16 = _mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3]));
        m8 = _mm256_max_ps(_mm512_castps512_ps256(m16),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m16), 1)));
    }
#endif
    __m256 b = _mm256_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) {
        m8 = _mm256_max_ps(_mm256_loadu_ps(s + j), m8);
        b = _mm256_max_ps(_mm256_loadu_ps(s + j + 8), b);
    }
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(s + j), m8);
    float m = hmax256(_mm256_max_ps(m8, b));
    for (; j < n; j++) if (s[j] > m) m = s[j];
    return m;
}

/* Softmax numerators of each of G score rows of length n in place: exp(s - max); writes
 * each row's max and sum of numerators. */
static void softmax_rows(float *scores, int64_t G, int64_t n, float *row_max, float *row_sum) {
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * n;
        const float m = max_of(s, n);
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
 * keys first .. first + n - 1 (sw: the row's own key, key_swap). part_max == NULL: o = the
 * normalized output. Otherwise a partial result over this run of keys, for merging
 * (attend_split): o = unnormalized sum_j exp(s_j - max) v_j, part_max / part_sum = each
 * head's max score and sum of exps. */
static void attend(const float *qv, int64_t G, int64_t D, const void *k_cache, const void *v_cache,
                   const float *k_scale, const float *v_scale, int dt, const int64_t *table,
                   int64_t bs, int64_t Hkv, int64_t kvh, key_swap sw, int64_t first, int64_t n,
                   float scale, float *o, float *scores, float *part_max, float *part_sum) {
    float mx[ATT_MAX_G], sm[ATT_MAX_G];
    const int fast = dt != KV_I8 && D % 32 == 0;
    if (fast) {
        scores_kv(qv, G, D, k_cache, dt, table, bs, Hkv, kvh, sw, first, n, scale, scores);
    } else {
        int64_t blk = first / bs, off = first % bs;
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = key_slot(table, blk, off, bs, sw) * Hkv + kvh;
            if (++off == bs) { off = 0; blk++; }
            for (int64_t g = 0; g < G; g++)
                scores[g * n + j] = dt == KV_I8
                    ? dot_i8(qv + g * D, (const int8_t *)k_cache + slot * D, D) * (k_scale[slot] * scale)
                    : dot_kv(qv + g * D, kv_at(k_cache, slot * D, dt), D, dt) * scale;
        }
    }
    softmax_rows(scores, G, n, mx, sm);
    if (fast) {
        weighted_values_kv(scores, G, D, v_cache, dt, table, bs, Hkv, kvh, sw, first, n, o, D);
    } else {
        for (int64_t g = 0; g < G; g++) memset(o + g * D, 0, sizeof(float) * (size_t)D);
        int64_t blk = first / bs, off = first % bs;
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = key_slot(table, blk, off, bs, sw) * Hkv + kvh;
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

/* Walks the keys first, first + 1, .. of a run through a block table (and the row's
 * swap), one slot row of row_len values each, with a second cursor about ATT_PF_BYTES ahead
 * (4 to 32 keys) whose rows the arithmetic prefetches while inside the run (pf_spread: the
 * loads wait on cache misses otherwise, each key's row being a new stretch of the cache).
 * The look-ahead ignores the swap: one key's row missed. */
typedef struct { int64_t blk, off, pf, pf_blk, pf_off, end; key_swap sw; } slot_walk;

static inline slot_walk walk_from(int64_t first, int64_t n, int64_t bs, int64_t row_bytes,
                                  key_swap sw) {
    slot_walk w = {first / bs, first % bs, first, first / bs, first % bs, first + n, sw};
    int64_t ahead = ATT_PF_BYTES / row_bytes;
    ahead = ahead < 4 ? 4 : ahead > 32 ? 32 : ahead;
    for (int k = 0; k < ahead && w.pf < w.end; k++, w.pf++)
        if (++w.pf_off == bs) { w.pf_off = 0; w.pf_blk++; }
    return w;
}

/* The current key's row (a float cache of value type dt); steps to the next key. *ahead:
 * the look-ahead cursor's row, or NULL past the run's end. */
static inline const void *walk_next(slot_walk *w, const void *cache, const int64_t *table,
                                    int64_t bs, int64_t row_len, int dt, const char **ahead) {
    const void *row = kv_at(cache, key_slot(table, w->blk, w->off, bs, w->sw) * row_len, dt);
    if (++w->off == bs) { w->off = 0; w->blk++; }
    *ahead = NULL;
    if (w->pf < w->end) {
        *ahead = (const char *)kv_at(cache, (table[w->pf_blk] * bs + w->pf_off) * row_len, dt);
        w->pf++;
        if (++w->pf_off == bs) { w->pf_off = 0; w->pf_blk++; }
    }
    return row;
}

/* All Hq query heads of one row over keys first .. first + n - 1 (sw: key_swap), cache of
 * value type dt (int8 with per-slot scales k_scale / v_scale [slots, Hkv], each taken at
 * the slot the key was read from), D % 32 == 0: each key's K
 * row and V row (every KV head, contiguous) are read once, in slot order, so a block is one
 * sequential stretch, instead of one strided pass per KV head. For float caches the
 * arithmetic per head is scores_kv's and weighted_values_kv's, in the same order, so the
 * result is bit-identical to attend(). scores [Hq][n], stats [2 Hq] (each head's max
 * score, then sum of exps), o [Hq][D]: normalized, or with ``partial`` the unnormalized
 * sums of a run for attend_split to merge. */
static inline __attribute__((always_inline)) void attend_heads_as(
        const float *qv, int64_t Hq, int64_t Hkv, int64_t D, const void *k_cache,
        const void *v_cache, const float *k_scale, const float *v_scale, int dt,
        const int64_t *table, int64_t bs, key_swap sw, int64_t first, int64_t n, float scale,
        float *o, float *scores, float *stats, int partial) {
    const int64_t group = Hq / Hkv, row_len = Hkv * D;
    slot_walk keys = walk_from(first, n, bs, row_len * kv_elem_bytes(dt), sw);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const void *rows[4];
        int64_t slots[4];
        pf_spread ahead = {{NULL}, 0, (D * kv_elem_bytes(dt) + 63) / 64};
        for (int r = 0; r < 4; r++) {
            rows[r] = walk_next(&keys, k_cache, table, bs, row_len, dt, &ahead.row[r]);
            slots[r] = ((const char *)rows[r] - (const char *)k_cache) / (row_len * kv_elem_bytes(dt));
        }
        for (int64_t h0 = 0, h1; h0 < Hq; h0 = h1) {   /* heads of one KV head, ATT_HB at a time */
            const int64_t kvh = h0 / group;
            h1 = h0 + ATT_HB < (kvh + 1) * group ? h0 + ATT_HB : (kvh + 1) * group;
            __m128 s4[ATT_HB];
            /* the KV head's part of the rows ahead, by its first run of heads */
            const pf_spread *pf = pf_head(&ahead, kvh, D, dt, h0 == kvh * group);
            switch (h1 - h0) {   /* a constant head count: the accumulators stay in registers */
#define ATT_DOT4_HEADS(HB) dot4_heads(qv + h0 * D, D, HB, rows, kvh * D, scale, dt, s4, pf); break;
            case 1: ATT_DOT4_HEADS(1)
            case 3: ATT_DOT4_HEADS(3)
#if ATT_HB > 3
            case 4: ATT_DOT4_HEADS(4)
#endif
            default: ATT_DOT4_HEADS(2)
#undef ATT_DOT4_HEADS
            }
            for (int64_t h = h0; h < h1; h++) {
                if (dt == KV_I8)
                    s4[h - h0] = _mm_mul_ps(s4[h - h0], _mm_set_ps(
                        k_scale[slots[3] * Hkv + kvh], k_scale[slots[2] * Hkv + kvh],
                        k_scale[slots[1] * Hkv + kvh], k_scale[slots[0] * Hkv + kvh]));
                _mm_storeu_ps(scores + h * n + j, s4[h - h0]);
            }
        }
    }
    for (; j < n; j++) {
        const char *unused;
        const void *row = walk_next(&keys, k_cache, table, bs, row_len, dt, &unused);
        const int64_t slot = ((const char *)row - (const char *)k_cache) / (row_len * kv_elem_bytes(dt));
        for (int64_t h = 0; h < Hq; h++) {
            float s = dot_kv(qv + h * D, kv_at(row, (h / group) * D, dt), D, dt) * scale;
            scores[h * n + j] = dt == KV_I8 ? s * k_scale[slot * Hkv + h / group] : s;
        }
    }
    softmax_rows(scores, Hq, n, stats, stats + Hq);
    memset(o, 0, sizeof(float) * (size_t)(Hq * D));
    slot_walk values = walk_from(first, n, bs, row_len * kv_elem_bytes(dt), sw);
    /* four keys at a time (add4_heads), then the rest one by one */
    for (j = 0; j + 4 <= n; j += 4) {
        const void *rows[4];
        int64_t slots[4];
        pf_spread ahead = {{NULL}, 0, (D * kv_elem_bytes(dt) + 63) / 64};
        for (int r = 0; r < 4; r++) {
            rows[r] = walk_next(&values, v_cache, table, bs, row_len, dt, &ahead.row[r]);
            slots[r] = dt == KV_I8 ? ((const char *)rows[r] - (const char *)v_cache) / row_len : 0;
        }
        for (int64_t h0 = 0, h1; h0 < Hq; h0 = h1) {
            const int64_t kvh = h0 / group;
            h1 = h0 + ATT_HB < (kvh + 1) * group ? h0 + ATT_HB : (kvh + 1) * group;
            float w[ATT_HB][4];
            const pf_spread *pf = pf_head(&ahead, kvh, D, dt, h0 == kvh * group);
            for (int64_t h = h0; h < h1; h++)
                for (int r = 0; r < 4; r++) {
                    const float p = scores[h * n + j + r];
                    w[h - h0][r] = dt == KV_I8 ? p * v_scale[slots[r] * Hkv + kvh] : p;
                }
            switch (h1 - h0) {
#define ATT_ADD4_HEADS(HB) add4_heads(o + h0 * D, D, HB, w, rows, kvh * D, dt, pf); break;
            case 1: ATT_ADD4_HEADS(1)
            case 3: ATT_ADD4_HEADS(3)
#if ATT_HB > 3
            case 4: ATT_ADD4_HEADS(4)
#endif
            default: ATT_ADD4_HEADS(2)
#undef ATT_ADD4_HEADS
            }
        }
    }
    for (; j < n; j++) {
        const char *unused;
        const void *row = walk_next(&values, v_cache, table, bs, row_len, dt, &unused);
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
                         key_swap sw, int64_t first, int64_t n, float scale, float *o,
                         float *scores, float *stats, int partial) {
#define ATTEND_HEADS_AS(DT) attend_heads_as(qv, Hq, Hkv, D, k_cache, v_cache, k_scale, v_scale, \
                                            DT, table, bs, sw, first, n, scale, o, scores, stats, \
                                            partial)
    switch (dt) {
    case KV_F16: ATTEND_HEADS_AS(KV_F16); break;
    case KV_BF16: ATTEND_HEADS_AS(KV_BF16); break;
    case KV_I8: ATTEND_HEADS_AS(KV_I8); break;
    default: ATTEND_HEADS_AS(KV_F32);
    }
#undef ATTEND_HEADS_AS
}

/* What every row of one call reads: the caches, their layout and the score scale. */
typedef struct {
    const void *k_cache, *v_cache;
    const float *k_scale, *v_scale;
    int dt;
    int64_t Hq, Hkv, D, bs;
    float scale;
} att_kv;

/* The runs a row of n keys is split into: nthreads once each would get ATT_SPLIT_MIN keys,
 * else 1. It depends on the row alone, never on the batch around it, so a token's output
 * has the same bits decoded alone, inside a speculative run or a prefix-cached chunk, and
 * beside any other requests (the partial sums and their merge round differently from one
 * pass over the keys). */
static inline int64_t row_parts(int64_t n, int nthreads) {
    return nthreads > 1 && nthreads <= 64 && n >= (int64_t)ATT_SPLIT_MIN * nthreads ? nthreads : 1;
}

/* Run s of S of a row's keys first .. first + n - 1, every head (D % 32 == 0: attend_heads,
 * one sequential stretch of slot rows; else one pass per KV head): the unnormalized sums
 * into part [Hq][D], each head's max score and sum of exps into pmax, psum [Hq]. scores:
 * Hq * (n / S + 1) + 2 Hq floats. sw: the row's swap (only the last run holds its key). */
static void attend_part(const att_kv *c, const float *qv, const int64_t *table, key_swap sw,
                        int64_t first, int64_t n, int64_t S, int64_t s, float *part, float *pmax,
                        float *psum, float *scores) {
    const int64_t Hq = c->Hq, D = c->D, group = Hq / c->Hkv;
    const int64_t lo = first + n * s / S, hi = first + n * (s + 1) / S;
    if (hi == lo) {   /* an empty run adds nothing */
        for (int64_t h = 0; h < Hq; h++) { pmax[h] = -INFINITY; psum[h] = 0.0f; }
        memset(part, 0, sizeof(float) * (size_t)(Hq * D));
    } else if (D % 32 == 0) {
        float *stats = scores + Hq * (hi - lo);
        attend_heads(qv, Hq, c->Hkv, D, c->k_cache, c->v_cache, c->k_scale, c->v_scale, c->dt,
                     table, c->bs, sw, lo, hi - lo, c->scale, part, scores, stats, 1);
        memcpy(pmax, stats, sizeof(float) * (size_t)Hq);
        memcpy(psum, stats + Hq, sizeof(float) * (size_t)Hq);
    } else {
        for (int64_t h0 = 0; h0 < Hq; h0 += group)
            attend(qv + h0 * D, group, D, c->k_cache, c->v_cache, c->k_scale, c->v_scale, c->dt,
                   table, c->bs, c->Hkv, h0 / group, sw, lo, hi - lo, c->scale, part + h0 * D,
                   scores, pmax + h0, psum + h0);
    }
}

/* A row's S runs (part [S][Hq][D], pmax / psum [S][Hq]) merged by max rescaling into the
 * normalized o [Hq][D]. */
static void merge_parts(const att_kv *c, int64_t S, const float *part, const float *pmax,
                        const float *psum, float *o) {
    const int64_t Hq = c->Hq, D = c->D;
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
}

/* Floats of the runs of a row in S parts: part [S][Hq][D], then pmax and psum [S][Hq]. */
static inline int64_t parts_floats(const att_kv *c, int64_t S) { return S * c->Hq * (c->D + 2); }

/* A row split in S runs, one after another on this thread (buf: parts_floats, scores as
 * attend_part's): the same bits as the runs spread over threads (split_rows). */
static void attend_split_here(const att_kv *c, const float *qv, const int64_t *table,
                              key_swap sw, int64_t first, int64_t n, int64_t S, float *o,
                              float *buf, float *scores) {
    float *pmax = buf + S * c->Hq * c->D, *psum = pmax + S * c->Hq;
    for (int64_t s = 0; s < S; s++)
        attend_part(c, qv, table, sw, first, n, S, s, buf + s * c->Hq * c->D, pmax + s * c->Hq,
                    psum + s * c->Hq, scores);
    merge_parts(c, S, buf, pmax, psum, o);
}

/* A query row whose keys are split: its index, its request's block table, its swap, its
 * keys. */
typedef struct { int64_t row; const int64_t *table; key_swap sw; int64_t first, n; } split_row;

/* Few requests: the S runs of every split row as parallel tasks (schedule(static, 1): with
 * S = nthreads each thread takes one run of each row), then each row's merge. Returns
 * nonzero if out of memory. */
static int split_rows(const att_kv *c, const float *q, int64_t q_stride, const split_row *rows,
                      int64_t nrows, int64_t S, float *out, int nthreads) {
    const int64_t per_row = parts_floats(c, S), Hq = c->Hq, D = c->D;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(nrows * per_row));
    if (!buf) return 1;
    int failed = 0;
    #pragma omp parallel for schedule(static, 1) num_threads(nthreads)
    for (int64_t task = 0; task < nrows * S; task++) {
        const split_row *r = rows + task / S;
        const int64_t s = task % S;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(Hq * (r->n / S + 1) + 2 * Hq + 8));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *part = buf + (task / S) * per_row, *pmax = part + S * Hq * D, *psum = pmax + S * Hq;
        attend_part(c, q + r->row * q_stride, r->table, r->sw, r->first, r->n, S, s,
                    part + s * Hq * D, pmax + s * Hq, psum + s * Hq, scores);
        free(scores);
    }
    if (!failed)
        for (int64_t i = 0; i < nrows; i++) {
            float *part = buf + i * per_row, *pmax = part + S * Hq * D;
            merge_parts(c, S, part, pmax, pmax + S * Hq, out + rows[i].row * Hq * D);
        }
    free(buf);
    return failed;
}

/* The first key position a query at position p sees (window <= 0: no window). */
static inline int64_t window_first(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* The slot of position pos through a request's block table. */
static inline int64_t pos_slot(const int64_t *table, int64_t pos, int64_t bs) {
    return table[pos / bs] * bs + pos % bs;
}

/* Query row `row` of a request, its index position idx (ctx + i): its position *p
 * (q_pos[row], or idx where q_pos is NULL) and the swap that reads its own key, written at
 * the slot of idx, in place of the key at *p. */
static inline key_swap row_key(const int64_t *q_pos, int64_t row, int64_t idx,
                               const int64_t *table, int64_t bs, int64_t *p) {
    *p = q_pos ? q_pos[row] : idx;
    if (*p == idx) return NO_SWAP;
    return (key_swap){pos_slot(table, *p, bs), pos_slot(table, idx, bs)};
}

/* The requests of one call: block_tables [B, bt_stride]; request b's query rows q_start[b]
 * .. + q_len[b] - 1 end at index position seq_len[b] - 1; q_pos: NULL, or each row's
 * position (row_key); window <= 0: none. */
typedef struct {
    const int64_t *block_tables;
    int64_t bt_stride, B, bs;
    const int64_t *q_start, *q_len, *seq_len, *q_pos;
    int64_t window;
} att_batch;

/* Few requests: every row of the batch (T rows) whose keys split into S runs, through
 * split_rows; *nrows: how many. Returns nonzero if out of memory. */
static int split_long_rows(const att_kv *c, const att_batch *a, const float *q, int64_t q_stride,
                           int64_t T, int64_t S, float *out, int nthreads, int64_t *nrows) {
    split_row *rows = (split_row *)malloc(sizeof(split_row) * (size_t)(T > 0 ? T : 1));
    if (!rows) return 1;
    *nrows = 0;
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t i = 0; i < a->q_len[b]; i++) {
            const int64_t row = a->q_start[b] + i, *table = a->block_tables + b * a->bt_stride;
            int64_t p;
            const key_swap sw = row_key(a->q_pos, row, a->seq_len[b] - a->q_len[b] + i, table,
                                        a->bs, &p);
            const int64_t first = window_first(p, a->window);
            if (row_parts(p - first + 1, nthreads) > 1)
                rows[(*nrows)++] = (split_row){row, table, sw, first, p - first + 1};
        }
    const int failed = *nrows ? split_rows(c, q, q_stride, rows, *nrows, S, out, nthreads) : 0;
    free(rows);
    return failed;
}

/* One task = one request x a run of query heads: every head when requests alone keep every
 * thread busy (float caches: attend_heads), else the heads sharing a KV head (the
 * whole GQA group when there are enough tasks, else one head); all of that request's
 * query tokens. A row with ATT_SPLIT_MIN x nthreads keys or more is split into nthreads
 * runs whatever the batch (row_parts): with few requests the runs of all such rows are the
 * parallel tasks (split_long_rows), with many each is its request task's, run by run.
 * q [T, Hq, D] with q_stride floats between tokens, out [T, Hq, D] contiguous; caches
 * [num_blocks, bs, Hkv, D] of dt: KV_F32, KV_F16, KV_BF16, or KV_I8 with a float scale per
 * slot per KV head (k_scale / v_scale: value = scale[block, offset, head] * int8);
 * block_tables [B, bt_stride];
 * request b has query rows q_start[b] .. q_start[b] + q_len[b] - 1; row i's K/V sit at
 * the slot of its index position ctx + i (ctx = seq_len[b] - q_len[b]). q_pos NULL: row i
 * sits at position p = ctx + i. Otherwise (speculative draft trees) q_pos[q_start[b] + i]
 * is its position p <= ctx + i: a leaf alternative to the chain node at p reads the keys
 * before p through the table as usual and its own key at p from the slot of ctx + i
 * (key_swap), with the bits of a row at p whose cache held it there. Each row attends to
 * keys at positions <= p and > p - window (window <= 0: no window). Returns nonzero if a
 * buffer could not be allocated (out then undefined). */
int tm_paged_attention(const float *q, int64_t q_stride, int64_t Hq, int64_t D, const void *k_cache,
                       const void *v_cache, const float *k_scale, const float *v_scale, int dt,
                       int64_t bs, int64_t Hkv, const int64_t *block_tables,
                       int64_t bt_stride, int64_t B, const int64_t *q_start, const int64_t *q_len,
                       const int64_t *seq_len, const int64_t *q_pos, float scale, int64_t window,
                       float *out, int nthreads) {
    const att_kv c = {k_cache, v_cache, k_scale, v_scale, dt, Hq, Hkv, D, bs, scale};
    const int64_t group = Hq / Hkv, S = row_parts(INT64_MAX, nthreads);
    /* enough requests to keep every thread busy with whole requests (or one thread): one
     * task per request, all heads at once (sequential cache reads; on one thread the
     * per-KV-head tasks read each key's row in Hkv strided passes, 3x slower for SmolLM2's
     * heads). int8 caches always take it: their per-head path (attend) rounds differently,
     * and one request must not change numbers with the batch it is in */
    const int all_heads = D % 32 == 0 && (B >= 2 * nthreads || nthreads == 1 || dt == KV_I8);
    const int64_t G = all_heads ? Hq : (B * Hkv >= 2 * nthreads && group <= ATT_MAX_G) ? group : 1;
    const int64_t runs = Hq / G;   /* head runs per request */
    int64_t max_len = 1, T = 0;
    for (int64_t b = 0; b < B; b++) {
        if (seq_len[b] > max_len) max_len = seq_len[b];
        T += q_len[b];
    }
    /* tasks the batch offers as whole requests: one per request for whole-row reads (D % 32
     * == 0), else one per request and KV head. Fewer than 2 x threads: the split rows' runs
     * become the parallel tasks, before the rest */
    const int few = (D % 32 == 0 ? B : B * Hkv) < 2 * nthreads;
    if (few && S > 1) {
        int64_t nrows = 0;
        const att_batch batch = {block_tables, bt_stride, B, bs, q_start, q_len, seq_len, q_pos,
                                 window};
        const int failed = split_long_rows(&c, &batch, q, q_stride, T, S, out, nthreads, &nrows);
        if (failed || nrows == T) return failed;
    }
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (B * runs > 1)
    {
        const int64_t score_len = G * max_len > Hq * (max_len / S + 1) ? G * max_len : Hq * (max_len / S + 1);
        const int64_t buf_len = few ? 0 : parts_floats(&c, S);
        float *scores = (float *)malloc(sizeof(float) * (size_t)(score_len + 2 * Hq + 8 + buf_len));
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
                    const int64_t row = q_start[b] + i;
                    int64_t p;
                    const key_swap sw = row_key(q_pos, row, ctx + i, table, bs, &p);
                    const int64_t first = window_first(p, window), n = p - first + 1;
                    if (row_parts(n, nthreads) > 1) {   /* split: done above, or here whole */
                        if (!few && r == 0)
                            attend_split_here(&c, q + row * q_stride, table, sw, first, n, S,
                                              out + row * Hq * D, scores + score_len + 2 * Hq + 8,
                                              scores);
                        continue;
                    }
                    if (all_heads)
                        attend_heads(q + row * q_stride, Hq, Hkv, D, k_cache, v_cache, k_scale,
                                     v_scale, dt, table, bs, sw, first, n, scale,
                                     out + row * Hq * D, scores, scores + G * max_len, 0);
                    else
                        attend(q + row * q_stride + h0 * D, G, D, k_cache, v_cache, k_scale, v_scale,
                               dt, table, bs, Hkv, kvh, sw, first, n, scale,
                               out + (row * Hq + h0) * D, scores, NULL, NULL);
                }
            }
        }
        free(scores);
    }
    return failed;
}
