/* bf16 mode's prefill attention on AMX tiles (cpu_gemm_dtype="bfloat16", a bfloat16 KV
 * cache, a CPU whose bf16 matmuls take the tiles): the scores q . k and the sums p . v are
 * tdpbf16ps products, the softmax stays float32. Included after cpu_prefill.c and
 * cpu_gemm_bf16.c (it reuses pf_row, pf_exp, round_bf16, the tile config).
 *
 * What a query row at position p gets (keys [lo, p] visible, lo = 0 or p - window + 1):
 *   q rounded to bf16 (round_bf16); keys in blocks of PA_KB = 32 at absolute positions;
 *   s_j    = (q . k_j as tdpbf16ps sums it: per 16 pairs of d, even and odd chains, then
 *            added) * scale; invisible keys -inf;
 *   m_new  = max(m, the block's s); alpha = exp(m - m_new) (0 before any key); p_j =
 *            exp(s_j - m_new); l = l alpha + (sum of the block's 32 p_j, a fixed tree);
 *   o      = fma(o, alpha, P . V) with P the p_j rounded to bf16 and P . V tdpbf16ps' sums
 *            over the block's 16 key pairs;
 * and the output is o * (1 / l). Each row's bits depend on the row alone (AMX rows are
 * independent, blocks sit at absolute positions, a block a row does not see leaves it
 * unchanged: alpha = exp(0) = 1 and P . V = 0), so a prompt prefilled in chunks or after a
 * prefix-cache hit gets the bits of the same prompt prefilled at once (tests: within bf16
 * precision of a float64 reference, and those bits; tests/layers/test_prefill_attention.py).
 *
 * Before the tasks, each (request, KV head) gets its keys and values in AMX's B layout
 * once: k^T tiles (16 pairs of d x 16 keys) and v tiles (16 pairs of keys x 16 values of
 * d). A task is then 16 query rows x the query heads of one KV head, as in pf_task, in
 * tiles of 16 (row, head) pairs. */
#if defined(__AVX512F__)
#define PA_KB 32

/* One (request, KV head)'s keys from block kb0 on, laid out for the tiles: kt holds, per
 * key block, 2 halves x D / 32 tiles of [16 d pairs][16 keys] dwords; vt per key block
 * D / 16 tiles of [16 key pairs][16 d][2] values. Keys at or past n_keys are zero. */
typedef struct { uint32_t *kt; uint16_t *vt; int64_t kb0, nkb; } pa_layout;

static void pa_lay_out(const att_kv *c, const int64_t *table, int64_t g, int64_t kb0,
                       int64_t nkb, int64_t n_keys, pa_layout *lay) {
    const int64_t D = c->D, D2 = D / 2, dt32 = D / 32, dt16 = D / 16;
    for (int64_t b = 0; b < nkb; b++) {
        uint32_t *kt = lay->kt + b * 2 * dt32 * 256;
        uint16_t *vt = lay->vt + b * dt16 * 512;
        for (int64_t j = 0; j < PA_KB; j++) {
            const int64_t pos = (kb0 + b) * PA_KB + j, half = j / 16, key = j % 16;
            const int64_t kp = j / 2, parity = j % 2;
            const int real = pos < n_keys;
            const uint32_t *k = real ? (const uint32_t *)pf_row(c, c->k_cache, table, g, pos) : NULL;
            const uint16_t *v = real ? (const uint16_t *)pf_row(c, c->v_cache, table, g, pos) : NULL;
            for (int64_t dp = 0; dp < D2; dp++)
                kt[((half * dt32 + dp / 16) * 16 + dp % 16) * 16 + key] = real ? k[dp] : 0;
            for (int64_t d = 0; d < D; d++)
                vt[(((d / 16) * 16 + kp) * 16 + d % 16) * 2 + parity] = real ? v[d] : 0;
        }
    }
}

/* Sum of 32 floats in a fixed order (the two halves added lane-wise, then a tree). */
static inline float pa_sum32(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

/* 16 (row, head) pairs t0 .. t0 + 15 of a task (np of them real), their q rows rounded in
 * qb [16][D]; pos_lo / pos_hi: each pair's first and last visible key (padding: none). */
AMX_TARGET static void pa_tile(const att_kv *c, const pa_layout *lay, const uint16_t *qb,
                               const int64_t *pos_lo, const int64_t *pos_hi, int np,
                               int64_t kb_lo, int64_t kb_hi, float *o /* [16][D] */,
                               float *l /* [16] */) {
    const int64_t D = c->D, dt32 = D / 32, dt16 = D / 16;
    float m[16] __attribute__((aligned(64))), alpha[16] __attribute__((aligned(64)));
    float m_sub[16] __attribute__((aligned(64)));
    float s[16][PA_KB] __attribute__((aligned(64)));
    uint16_t pb[16][PA_KB] __attribute__((aligned(64)));
    float cv[4][16][16] __attribute__((aligned(64)));
    for (int i = 0; i < 16; i++) { m[i] = -INFINITY; l[i] = 0.0f; }
    memset(o, 0, sizeof(float) * (size_t)(16 * D));
    const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(c->scale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t kb = kb_lo; kb <= kb_hi; kb++) {
        const uint32_t *kt = lay->kt + (kb - lay->kb0) * 2 * dt32 * 256;
        const uint16_t *vt = lay->vt + (kb - lay->kb0) * dt16 * 512;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t dt = 0; dt < dt32; dt++) {
            _tile_loadd(2, qb + dt * 32, D * 2);
            _tile_loadd(3, kt + dt * 256, 64);
            _tile_loadd(5, kt + (dt32 + dt) * 256, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 5);
        }
        _tile_stored(0, &s[0][0], PA_KB * 4);
        _tile_stored(1, &s[0][16], PA_KB * 4);
        const int64_t key0 = kb * PA_KB;
        __m512 sv[16][2];
        for (int i = 0; i < 16; i++) {
            __m512 s0 = ninf, s1 = ninf;
            if (i < np) {   /* visible keys: pos_lo <= key <= pos_hi */
                const __m512i k0 = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 - pos_lo[i])));
                const __m512i k1 = _mm512_add_epi32(k0, _mm512_set1_epi32(16));
                const __m512i span = _mm512_set1_epi32((int)(pos_hi[i] - pos_lo[i]));
                const __mmask16 v0 = _mm512_cmp_epu32_mask(k0, span, _MM_CMPINT_LE);
                const __mmask16 v1 = _mm512_cmp_epu32_mask(k1, span, _MM_CMPINT_LE);
                s0 = _mm512_mask_blend_ps(v0, ninf, _mm512_mul_ps(_mm512_load_ps(s[i]), scale));
                s1 = _mm512_mask_blend_ps(v1, ninf, _mm512_mul_ps(_mm512_load_ps(s[i] + 16), scale));
            }
            sv[i][0] = s0;
            sv[i][1] = s1;
            const float mb = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            const float m_new = mb > m[i] ? mb : m[i];
            m_sub[i] = m_new == -INFINITY ? 0.0f : m_new;   /* exp(-inf - 0) = 0, never NaN */
            alpha[i] = m[i] - m_sub[i];
            m[i] = m_new;
        }
        _mm512_store_ps(alpha, pf_exp(_mm512_load_ps(alpha)));
        for (int i = 0; i < 16; i++) {
            const __m512 sub = _mm512_set1_ps(m_sub[i]);
            const __m512 p0 = pf_exp(_mm512_sub_ps(sv[i][0], sub)), p1 = pf_exp(_mm512_sub_ps(sv[i][1], sub));
            l[i] = l[i] * alpha[i] + pa_sum32(p0, p1);
            float p[PA_KB] __attribute__((aligned(64)));
            _mm512_store_ps(p, p0);
            _mm512_store_ps(p + 16, p1);
            round_bf16(p, PA_KB, pb[i]);
        }
        /* P . V, up to four 16-value slices of d at once (tiles 0-3: the scores are out) */
        _tile_loadd(4, &pb[0][0], PA_KB * 2);
        for (int64_t d0 = 0; d0 < dt16; d0 += 4) {
            const int nt = dt16 - d0 < 4 ? (int)(dt16 - d0) : 4;
            _tile_zero(0);
            _tile_loadd(5, vt + d0 * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nt > 1) { _tile_zero(1); _tile_loadd(6, vt + (d0 + 1) * 512, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nt > 2) { _tile_zero(2); _tile_loadd(7, vt + (d0 + 2) * 512, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nt > 3) { _tile_zero(3); _tile_loadd(5, vt + (d0 + 3) * 512, 64); _tile_dpbf16ps(3, 4, 5); }
            _tile_stored(0, &cv[0][0][0], 64);
            if (nt > 1) _tile_stored(1, &cv[1][0][0], 64);
            if (nt > 2) _tile_stored(2, &cv[2][0][0], 64);
            if (nt > 3) _tile_stored(3, &cv[3][0][0], 64);
            for (int i = 0; i < np; i++) {
                const __m512 a = _mm512_set1_ps(alpha[i]);
                for (int t = 0; t < nt; t++) {
                    float *oi = o + i * D + (d0 + t) * 16;
                    _mm512_storeu_ps(oi, _mm512_fmadd_ps(_mm512_loadu_ps(oi), a, _mm512_load_ps(cv[t][i])));
                }
            }
        }
    }
}

/* Rows row0 .. row0 + nr - 1 of q (positions p0 ..), the query heads of KV head g. */
AMX_TARGET static void pa_task(const att_kv *c, const pa_layout *lay, const float *q,
                               int64_t q_stride, int64_t row0, int64_t nr, int64_t p0, int64_t g,
                               int64_t window, float *out, uint16_t *qb, float *o) {
    const int64_t G = c->Hq / c->Hkv, D = c->D, P = nr * G;
    float l[16];
    for (int64_t t0 = 0; t0 < P; t0 += 16) {
        const int np = P - t0 < 16 ? (int)(P - t0) : 16;
        int64_t pos_lo[16], pos_hi[16], lo = INT64_MAX, hi = -1;
        for (int i = 0; i < 16; i++) {
            if (i < np) {
                const int64_t t = t0 + i, p = p0 + t / G;
                round_bf16(q + (row0 + t / G) * q_stride + (g * G + t % G) * D, D, qb + i * D);
                pos_lo[i] = window_first(p, window);
                pos_hi[i] = p;
                lo = pos_lo[i] < lo ? pos_lo[i] : lo;
                hi = p > hi ? p : hi;
            } else {
                memset(qb + i * D, 0, sizeof(uint16_t) * (size_t)D);
                pos_lo[i] = 0;
                pos_hi[i] = -1;
            }
        }
        pa_tile(c, lay, qb, pos_lo, pos_hi, np, lo / PA_KB, hi / PA_KB, o, l);
        for (int i = 0; i < np; i++) {
            const int64_t t = t0 + i;
            const float inv = 1.0f / l[i];
            float *dst = out + (row0 + t / G) * c->Hq * D + (g * G + t % G) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = o[i * D + d] * inv;
        }
    }
}

/* tm_prefill_attention's arguments; a bfloat16 cache, D % 32 == 0, AMX on (tm_amx_enable).
 * Returns nonzero when it cannot run (nothing written). */
AMX_TARGET int tm_prefill_attention_bf16(
        const float *q, int64_t q_stride, int64_t Hq, int64_t D, const void *k_cache,
        const void *v_cache, const float *k_scale, const float *v_scale, int dt, int64_t bs,
        int64_t Hkv, const int64_t *block_tables, int64_t bt_stride, int64_t B,
        const int64_t *q_start, const int64_t *q_len, const int64_t *seq_len, float scale,
        int64_t window, float *out, int nthreads) {
    if (!tm_amx_on || dt != KV_BF16 || k_scale || v_scale || D % 32 || Hq % Hkv || B <= 0)
        return 1;
    const att_kv c = {k_cache, v_cache, NULL, NULL, dt, Hq, Hkv, D, bs, scale};
    /* each request's key blocks: from its first row's first visible key to its last row */
    int64_t *kb0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * B)), *off = NULL;
    if (!kb0) return 1;
    int64_t *nkb = kb0 + B, total = 0;
    const int64_t ntasks = pf_num_tasks(q_len, B, Hkv);
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = window_first(seq_len[b] - q_len[b], window);
        kb0[b] = first / PA_KB;
        nkb[b] = q_len[b] > 0 ? (seq_len[b] - 1) / PA_KB - kb0[b] + 1 : 0;
        total += nkb[b];
    }
    /* per key block and KV head: k^T (D / 2 x 32 dwords) and v (D x 32 values) */
    const int64_t kt_block = 2 * (D / 32) * 256, vt_block = (D / 16) * 512;
    uint32_t *kt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(total * Hkv * kt_block + 16));
    uint16_t *vt = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(total * Hkv * vt_block + 32));
    off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    const int64_t per_thread = 16 * D * 2 + 16 * D * 4;   /* qb, o: bytes */
    char *scratch = (char *)aligned_alloc(64, (size_t)(nthreads * per_thread + 64));
    if (!kt || !vt || !off || !scratch) {
        free(kt); free(vt); free(off); free(scratch); free(kb0);
        return 1;
    }
    off[0] = 0;
    for (int64_t b = 0; b < B; b++) off[b + 1] = off[b] + nkb[b];
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t bg = 0; bg < B * Hkv; bg++) {
            const int64_t b = bg / Hkv, g = bg % Hkv;
            const int64_t at = off[b] * Hkv + g * nkb[b];
            pa_layout lay = {kt + at * kt_block, vt + at * vt_block, kb0[b], nkb[b]};
            pa_lay_out(&c, block_tables + b * bt_stride, g, kb0[b], nkb[b], seq_len[b], &lay);
        }
        amx_load_config(16);
        char *mine = scratch + (int64_t)omp_get_thread_num() * per_thread;
        uint16_t *qb = (uint16_t *)mine;
        float *o = (float *)(mine + 16 * D * 2);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks; task++) {
            const pf_where w = pf_task_at(task, q_len, Hkv);
            const int64_t b = w.b, at = off[b] * Hkv + w.g * nkb[b];
            const pa_layout lay = {kt + at * kt_block, vt + at * vt_block, kb0[b], nkb[b]};
            pa_task(&c, &lay, q, q_stride, q_start[b] + w.r0, w.nr, seq_len[b] - q_len[b] + w.r0,
                    w.g, window, out, qb, o);
        }
        _tile_release();
    }
    free(kt); free(vt); free(off); free(scratch); free(kb0);
    return 0;
}
#else
int tm_prefill_attention_bf16(const float *q, int64_t q_stride, int64_t Hq, int64_t D,
                              const void *k_cache, const void *v_cache, const float *k_scale,
                              const float *v_scale, int dt, int64_t bs, int64_t Hkv,
                              const int64_t *block_tables, int64_t bt_stride, int64_t B,
                              const int64_t *q_start, const int64_t *q_len, const int64_t *seq_len,
                              float scale, int64_t window, float *out, int nthreads) {
    return 1;   /* the AVX2 build: no AMX */
}
#endif
