/* Causal attention of prefill chunks, read straight from the paged cache (float32 / float16 /
 * bfloat16 values), with each query row's bits fixed by the row alone.
 *
 * A query row at position p sees keys [lo, p] (lo = 0, or p - window + 1). Its keys come in
 * blocks of PF_KB at absolute positions (PF_KB b ..), and each block updates the row's
 * running max, sum and output (online softmax):
 *   score_j  = (sum over d, in order, of q[d] k_j[d], one FMA each) * scale;
 *   m_new    = max(m, the block's visible scores); alpha = exp(m - m_new) (0 at the first);
 *   p_j      = exp(score_j - m_new); l = l alpha + p_0 + p_1 + ... (masked keys add 0);
 *   o        = o alpha, then one FMA p_j v_j per visible key in key order;
 * and the output is o / l. Nothing there depends on the rows sharing the call, the chunk
 * the row was prefilled in, or the build (every vector operation is per lane: a lane holds
 * one (row, head) pair's score or one output value), so a prompt prefilled after a
 * prefix-cache hit has the bits of the same prompt prefilled cold.
 *
 * A task is PF_ROWS query rows x the query heads of one KV head: its (row, head) pairs are
 * the lanes of the score vectors (q transposed once per task), so each key value is one
 * broadcast for every pair, and each value row chunk one load for every pair. A block's
 * float16 / bfloat16 K and V rows are widened to float32 once (exactly) into the task's
 * buffer: the broadcasts and loads then read floats, instead of widening each value again
 * for every group of pairs. */
#include <omp.h>

#define PF_ROWS 16   /* query rows per task */
#define PF_KB 16     /* keys per softmax block */
/* score vectors (of PF_W pairs) per pass over a block's keys: 3 x 4 keys of accumulators, 4
 * key broadcasts and a q vector fit AVX-512's 32 registers; AVX2's 16 take 2 (with 3 the
 * pass spilled to the stack: Gemma 3's heads ran 1.8x slower) */
#ifdef __AVX512F__
#define PF_PV 3
#else
#define PF_PV 2
#endif

#ifdef __AVX512F__
#define PF_W 16
#define PF_DC 4      /* value chunks of PF_W per pass: 4 pairs x 4 accumulators */
typedef __m512 pf_vec;
#define pf_load _mm512_loadu_ps
#define pf_store _mm512_storeu_ps
#define pf_set1 _mm512_set1_ps
#define pf_fma _mm512_fmadd_ps
#define pf_mul _mm512_mul_ps
#define pf_max _mm512_max_ps
#define pf_add _mm512_add_ps
#define pf_sub _mm512_sub_ps
static inline pf_vec pf_exp(pf_vec x) {   /* exp256 on each half: the same value in every lane */
    const __m256 lo = exp256(_mm512_castps512_ps256(x));
    const __m256 hi = exp256(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                               _mm256_castps_pd(hi), 1));
}
#else
#define PF_W 8
#define PF_DC 2
typedef __m256 pf_vec;
#define pf_load _mm256_loadu_ps
#define pf_store _mm256_storeu_ps
#define pf_set1 _mm256_set1_ps
#define pf_fma _mm256_fmadd_ps
#define pf_mul _mm256_mul_ps
#define pf_max _mm256_max_ps
#define pf_add _mm256_add_ps
#define pf_sub _mm256_sub_ps
static inline pf_vec pf_exp(pf_vec x) { return exp256(x); }
#endif

/* The key (or value) row of KV head g at position pos through a request's block table. */
static inline const void *pf_row(const att_kv *c, const void *cache, const int64_t *table,
                                 int64_t g, int64_t pos) {
    return kv_at(cache, ((table[pos / c->bs] * c->bs + pos % c->bs) * c->Hkv + g) * c->D, c->dt);
}

/* A cache row as float32: the row itself (float32 caches), else widened into dst (D values)
 * as the 16-bit GEMM widens its weight rows. */
static inline const float *pf_widened(const att_kv *c, const void *row, float *dst) {
    if (c->dt == KV_F32) return (const float *)row;
    gemm_widen_rows(row, c->dt, 1, c->D, dst);
    return dst;
}

/* Per-task buffers (floats): qt [D][Pv], s [PF_KB + 3][Pv] (scores come four keys at a
 * time: up to 3 rows past the block), m, l, alpha [Pv], o [P][D], where Pv is P rounded up
 * to whole vectors; kf, vf [PF_KB][D]: the block's K and V rows widened to float32. */
typedef struct { float *qt, *s, *m, *l, *alpha, *o, *kf, *vf; int64_t Pv; } pf_state;

static inline int64_t pf_pairs_max(const att_kv *c) {
    const int64_t P = PF_ROWS * (c->Hq / c->Hkv);
    return (P + PF_W - 1) / PF_W * PF_W;
}

static inline int64_t pf_buf_floats(const att_kv *c) {
    return pf_pairs_max(c) * (c->D + (PF_KB + 3) + 3 + c->D) + 2 * PF_KB * c->D;
}

/* Scores of NV vectors of pairs (from pair v0 PF_W) against four keys (rows k[0..3]): s
 * rows j0 .. j0 + 3. */
static inline __attribute__((always_inline)) void
pf_scores4(const pf_state *st, const int NV, int64_t v0, const float *const k[4], int64_t j0,
           int64_t D, float scale) {
    pf_vec acc[PF_PV][4];
    for (int v = 0; v < NV; v++)
        for (int r = 0; r < 4; r++) acc[v][r] = pf_set1(0.0f);
    const float *qt = st->qt + v0 * PF_W;
    for (int64_t d = 0; d < D; d++, qt += st->Pv) {
        pf_vec kd[4];
        for (int r = 0; r < 4; r++) kd[r] = pf_set1(k[r][d]);
        for (int v = 0; v < NV; v++) {
            const pf_vec qv = pf_load(qt + v * PF_W);
            for (int r = 0; r < 4; r++) acc[v][r] = pf_fma(qv, kd[r], acc[v][r]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < NV; v++)
            pf_store(st->s + (j0 + r) * st->Pv + (v0 + v) * PF_W, pf_mul(acc[v][r], pf_set1(scale)));
}

/* Every pair's scores against the block's keys [j0, j1) (offsets in the block; keys
 * past j1 - 1 within a group of four repeat it and are masked later). */
static void pf_block_scores(const att_kv *c, pf_state *st, const float *const *krows, int64_t j0,
                            int64_t j1) {
    for (int64_t j = j0; j < j1; j += 4) {
        const float *k[4];
        for (int r = 0; r < 4; r++) k[r] = krows[j + r < j1 ? j + r : j1 - 1];
        for (int64_t v0 = 0; v0 < st->Pv / PF_W; v0 += PF_PV) {
            const int64_t nv = st->Pv / PF_W - v0 < PF_PV ? st->Pv / PF_W - v0 : PF_PV;
            if (nv == 1) pf_scores4(st, 1, v0, k, j, c->D, c->scale);
            else if (nv == 2) pf_scores4(st, 2, v0, k, j, c->D, c->scale);
#if PF_PV > 2
            else pf_scores4(st, 3, v0, k, j, c->D, c->scale);
#endif
        }
    }
}

/* o (D values) = o * alpha, then one FMA per key j of [j0, j1) with weight s[j * Pv] (the
 * pair's column of the block's exps), from the value rows vrows. */
static void pf_values_one(const att_kv *c, const pf_state *st, const float *s, float alpha,
                          const float *const *vrows, int64_t j0, int64_t j1, float *o) {
    for (int64_t d = 0; d < c->D; d += PF_W) {
        pf_vec acc = pf_mul(pf_load(o + d), pf_set1(alpha));
        for (int64_t j = j0; j < j1; j++)
            acc = pf_fma(pf_set1(s[j * st->Pv]), pf_load(vrows[j] + d), acc);
        pf_store(o + d, acc);
    }
}

/* The same for four pairs t0 .. t0 + 3 over all PF_KB keys of a block every pair sees:
 * each value chunk loaded once for the four, PF_DC chunks at a time (the broadcast weights
 * are loads too). */
static inline __attribute__((always_inline)) void
pf_values_four_as(const att_kv *c, const pf_state *st, int64_t t0, const float *const *vrows,
                  int64_t d, const int DC) {
    pf_vec acc[4][PF_DC];
    for (int i = 0; i < 4; i++) {
        const pf_vec alpha = pf_set1(st->alpha[t0 + i]);
        for (int k = 0; k < DC; k++) acc[i][k] = pf_mul(pf_load(st->o + (t0 + i) * c->D + d + k * PF_W), alpha);
    }
    for (int64_t j = 0; j < PF_KB; j++) {
        pf_vec v[PF_DC];
        for (int k = 0; k < DC; k++) v[k] = pf_load(vrows[j] + d + k * PF_W);
        for (int i = 0; i < 4; i++) {
            const pf_vec p = pf_set1(st->s[j * st->Pv + t0 + i]);
            for (int k = 0; k < DC; k++) acc[i][k] = pf_fma(p, v[k], acc[i][k]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < DC; k++) pf_store(st->o + (t0 + i) * c->D + d + k * PF_W, acc[i][k]);
}

static void pf_values_four(const att_kv *c, const pf_state *st, int64_t t0, const float *const *vrows) {
    int64_t d = 0;
    for (; d + PF_DC * PF_W <= c->D; d += PF_DC * PF_W) pf_values_four_as(c, st, t0, vrows, d, PF_DC);
    for (; d < c->D; d += PF_W) pf_values_four_as(c, st, t0, vrows, d, 1);
}

/* The softmax update of every pair over a block whose keys [j0, j1) (offsets) exist, the
 * first at position b0 + j0; pos_lo / pos_hi [Pv]: each pair's first and last visible key
 * position (padding lanes: none); all_seen: every pair sees every key of the block (no
 * padding lanes either). Scores of keys a pair does not see become -inf, then
 * every score its exp (0 there); m, l and alpha (the factor its output is rescaled by)
 * per pair. A pair that sees no key of the block keeps m and l, with alpha exactly 1. */
static void pf_block_softmax(pf_state *st, int64_t b0, int64_t j0, int64_t j1, const float *pos_lo,
                             const float *pos_hi, int all_seen) {
    const pf_vec ninf = pf_set1(-INFINITY), zero = pf_set1(0.0f);
    for (int64_t v = 0; v < st->Pv; v += PF_W) {
        pf_vec mb = ninf;
        for (int64_t j = 0; j < PF_KB; j++) {
            float *sj = st->s + j * st->Pv + v;
            if (all_seen) { mb = pf_max(mb, pf_load(sj)); continue; }
            if (j < j0 || j >= j1) { pf_store(sj, ninf); continue; }
            const pf_vec key = pf_set1((float)(b0 + j));
#ifdef __AVX512F__
            const __mmask16 seen = _mm512_cmp_ps_mask(key, pf_load(pos_lo + v), _CMP_GE_OQ)
                                 & _mm512_cmp_ps_mask(key, pf_load(pos_hi + v), _CMP_LE_OQ);
            const pf_vec sv = _mm512_mask_blend_ps(seen, ninf, pf_load(sj));
#else
            const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(key, pf_load(pos_lo + v), _CMP_GE_OQ),
                                              _mm256_cmp_ps(key, pf_load(pos_hi + v), _CMP_LE_OQ));
            const pf_vec sv = _mm256_blendv_ps(ninf, pf_load(sj), seen);
#endif
            pf_store(sj, sv);
            mb = pf_max(mb, sv);
        }
        const pf_vec m = pf_load(st->m + v), m_new = pf_max(m, mb);
        /* subtract 0 where nothing has been seen yet: exp(-inf - 0) = 0, never NaN */
#ifdef __AVX512F__
        const pf_vec m_sub = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ), m_new, zero);
#else
        const pf_vec m_sub = _mm256_blendv_ps(m_new, zero, _mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ));
#endif
        const pf_vec alpha = pf_exp(pf_sub(m, m_sub));
        pf_vec l = pf_mul(pf_load(st->l + v), alpha);
        for (int64_t j = 0; j < PF_KB; j++) {
            float *sj = st->s + j * st->Pv + v;
            const pf_vec p = pf_exp(pf_sub(pf_load(sj), m_sub));
            pf_store(sj, p);
            l = pf_add(l, p);
        }
        pf_store(st->l + v, l);
        pf_store(st->alpha + v, alpha);
        pf_store(st->m + v, m_new);
    }
}

/* Rows row0 .. row0 + nr - 1 of q (positions p0 ..), the query heads of KV head g, over a
 * request's block table; buf: pf_buf_floats(c) floats. */
static void pf_task(const att_kv *c, const float *q, int64_t q_stride, int64_t row0, int64_t nr,
                    int64_t p0, int64_t g, const int64_t *table, int64_t window, float *out,
                    float *buf) {
    const int64_t G = c->Hq / c->Hkv, D = c->D, P = nr * G;   /* pairs (row, head), head fastest */
    pf_state st;
    st.Pv = (P + PF_W - 1) / PF_W * PF_W;
    st.qt = buf;
    st.s = st.qt + D * st.Pv;
    st.m = st.s + (PF_KB + 3) * st.Pv;
    st.l = st.m + st.Pv;
    st.alpha = st.l + st.Pv;
    st.o = st.alpha + st.Pv;
    st.kf = st.o + st.Pv * D;
    st.vf = st.kf + PF_KB * D;
    float pos_lo[PF_ROWS * ATT_MAX_G + PF_W], pos_hi[PF_ROWS * ATT_MAX_G + PF_W];
    for (int64_t t = 0; t < st.Pv; t++) {
        const int64_t r = t / G, p = p0 + r;
        for (int64_t d = 0; d < D; d++)
            st.qt[d * st.Pv + t] = t < P ? q[(row0 + r) * q_stride + (g * G + t % G) * D + d] : 0.0f;
        pos_lo[t] = t < P ? (float)window_first(p, window) : INFINITY;
        pos_hi[t] = t < P ? (float)p : -INFINITY;
        st.m[t] = -INFINITY;
        st.l[t] = 0.0f;
    }
    memset(st.o, 0, sizeof(float) * (size_t)(P * D));
    const int64_t first = window_first(p0, window), last = p0 + nr - 1;
    const int64_t lo_max = window_first(last, window);   /* the last row's first key */
    const float *krows[PF_KB], *vrows[PF_KB];
    for (int64_t b0 = first / PF_KB * PF_KB; b0 <= last; b0 += PF_KB) {
        const int64_t j0 = (b0 > first ? b0 : first) - b0, j1 = (b0 + PF_KB < last + 1 ? b0 + PF_KB : last + 1) - b0;
        for (int64_t j = j0; j < j1; j++) {
            krows[j] = pf_widened(c, pf_row(c, c->k_cache, table, g, b0 + j), st.kf + j * D);
            vrows[j] = pf_widened(c, pf_row(c, c->v_cache, table, g, b0 + j), st.vf + j * D);
        }
        const int all_see_all = j0 == 0 && j1 == PF_KB && b0 >= lo_max && b0 + PF_KB - 1 <= p0;
        pf_block_scores(c, &st, krows, j0, j1);
        pf_block_softmax(&st, b0, j0, j1, pos_lo, pos_hi, all_see_all && P == st.Pv);
        int64_t t = 0;
        if (all_see_all)
            for (; t + 4 <= P; t += 4) pf_values_four(c, &st, t, vrows);
        for (; t < P; t++) {
            const int64_t v0 = (int64_t)pos_lo[t] > b0 + j0 ? (int64_t)pos_lo[t] - b0 : j0;
            const int64_t v1 = (int64_t)pos_hi[t] + 1 < b0 + j1 ? (int64_t)pos_hi[t] + 1 - b0 : j1;
            if (v0 < v1)
                pf_values_one(c, &st, st.s + t, st.alpha[t], vrows, v0, v1, st.o + t * D);
        }
    }
    for (int64_t t = 0; t < P; t++) {
        const float inv = 1.0f / st.l[t];
        float *o = out + (row0 + t / G) * c->Hq * D + (g * G + t % G) * D;
        for (int64_t d = 0; d < D; d++) o[d] = st.o[t * D + d] * inv;
    }
}

/* The prefill tasks of a call: PF_ROWS query rows x one KV head of a request, request by
 * request. pf_num_tasks counts them; pf_task_at gives task's request b, KV head g, first
 * row r0 (within the request's rows) and row count nr. */
typedef struct { int64_t b, g, r0, nr; } pf_where;

static inline int64_t pf_request_tasks(int64_t q_len, int64_t Hkv) {
    return (q_len + PF_ROWS - 1) / PF_ROWS * Hkv;
}

static int64_t pf_num_tasks(const int64_t *q_len, int64_t B, int64_t Hkv) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) n += pf_request_tasks(q_len[b], Hkv);
    return n;
}

static inline pf_where pf_task_at(int64_t task, const int64_t *q_len, int64_t Hkv) {
    pf_where w = {0, 0, 0, 0};
    while (task >= pf_request_tasks(q_len[w.b], Hkv)) task -= pf_request_tasks(q_len[w.b++], Hkv);
    w.g = task % Hkv;
    w.r0 = task / Hkv * PF_ROWS;
    w.nr = q_len[w.b] - w.r0 < PF_ROWS ? q_len[w.b] - w.r0 : PF_ROWS;
    return w;
}

/* Prefill attention of the requests of a batch (their query rows, any count, end at position
 * seq_len - 1; the cache already holds every key they see) from float caches (dt: KV_F32 /
 * KV_F16 / KV_BF16; D % 16 == 0). Same arguments as tm_paged_attention (the int8 scales
 * must be NULL). Returns nonzero when it cannot run (an int8 cache, D % 16 != 0, a GQA group over
 * ATT_MAX_G, no memory): nothing is written then. */
int tm_prefill_attention(const float *q, int64_t q_stride, int64_t Hq, int64_t D,
                         const void *k_cache, const void *v_cache, const float *k_scale,
                         const float *v_scale, int dt, int64_t bs,
                         int64_t Hkv, const int64_t *block_tables, int64_t bt_stride, int64_t B,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *seq_len,
                         float scale, int64_t window, float *out, int nthreads) {
    if (dt == KV_I8 || k_scale || v_scale || D % 16 || Hq % Hkv || Hq / Hkv > ATT_MAX_G) return 1;
    const att_kv c = {k_cache, v_cache, NULL, NULL, dt, Hq, Hkv, D, bs, scale};
    const int64_t ntasks = pf_num_tasks(q_len, B, Hkv);
    float *bufs = (float *)malloc(sizeof(float) * (size_t)(nthreads * pf_buf_floats(&c)));
    if (!bufs) return 1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < ntasks; task++) {
        const pf_where w = pf_task_at(task, q_len, Hkv);
        pf_task(&c, q, q_stride, q_start[w.b] + w.r0, w.nr, seq_len[w.b] - q_len[w.b] + w.r0,
                w.g, block_tables + w.b * bt_stride, window, out,
                bufs + (int64_t)omp_get_thread_num() * pf_buf_floats(&c));
    }
    free(bufs);
    return 0;
}
