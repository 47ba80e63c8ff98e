/* A whole dense decoder stack (Llama, Mistral, Qwen2 / Qwen3, Gemma 3; the attention half of
 * MoE layers) for decode-sized batches (up to cpu_ops.LINEAR_MAX_ROWS tokens) in one call.
 * In eager mode each layer costs ~10 Python module calls and ~10 kernel calls, several
 * milliseconds per step in all; here the same kernels run back to back in C, in the same
 * order on the same buffers, so the result is bit-identical to the module path with the
 * fused kernels on (tests/models/test_llama_fused.py, test_fused_architectures.py).
 *
 * Per layer l (x [T, H] is the residual stream, updated in place):
 *   h = norm_in(x) ; qkv = h Wqkv^T (+ b) ; [q, k = per-head norms] ; rope(q, k)
 *   cache[slots] = k, v ; att = paged_attention(q, cache, window) ; o = att Wo^T (+ b)
 *   plain:    x += o ; h2 = norm_post_attn(x)
 *   sandwich: x += norm_post_attn(o) ; h2 = norm_pre_ffn(x)              (Gemma 3)
 *   f = (act(h2 Wgate^T) * (h2 Wup^T)) Wdown^T ; x += f, or x += norm_post_ffn(f)
 * What a layer has is its row of int64 fields (LD_*, built by runner/fused_plan.py): the
 * architectures differ in data, not in code paths of their own. */

/* One layer's descriptor: addresses (0 = the layer has none) and small codes. */
enum {
    LD_LINEARS,        /* 4 linear descriptors (qkv, o, gate_up, down; cpu_decode_linear.c) */
    LD_NORM_IN, LD_NORM_POST_ATTN,   /* float [H] weights */
    LD_NORM_PRE_FFN, LD_NORM_POST_FFN,   /* the sandwich norms, or 0 */
    LD_Q_NORM, LD_K_NORM,   /* float [D] per-head weights, or 0 */
    LD_BIAS_QKV, LD_BIAS_O, LD_BIAS_GATE_UP, LD_BIAS_DOWN,   /* float biases, or 0 */
    LD_GEMMA,          /* 1: every norm of the layer is x / rms(x) * (1 + w) */
    LD_ACT,            /* 0: silu, 1: gelu_tanh */
    LD_WINDOW,         /* sliding window in tokens, 0: full attention */
    LD_COS, LD_SIN,    /* the layer's RoPE tables [P, D] */
    LD_EPS, LD_SCALE,  /* norm eps and attention scale: float32 bit patterns */
    LD_FIELDS
};
#define DEC_ACT_GELU_TANH 1

static inline float ld_float(int64_t bits) {
    const uint32_t b = (uint32_t)bits;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* What is the same for every layer of one call. */
typedef struct {
    int64_t T, H, Hq, Hkv, D, I;
    const int64_t *pos, *q_start, *q_len, *seq_len;
    const int64_t *q_pos;   /* NULL, or each row's position in a draft tree (tm_paged_attention) */
    int64_t bs, B;
    int kv_dt, q8, nthreads;
} dec_step;

/* A layer's view of the paged cache: its KV group's slots of the step's tokens and block
 * tables (layers of a sliding window may have a pool and tables of their own). */
enum { LKV_SLOTS, LKV_TABLES, LKV_TABLE_STRIDE, LKV_FIELDS };

/* Scratch rows: h, h2 [T, H], qkv [T, (Hq + 2 Hkv) D], att [T, Hq D], gu [T, 2I], act [T, I],
 * tmp (the parts of a linear) and xp (permuted inputs). */
typedef struct { float *h, *h2, *qkv, *att, *gu, *act, *tmp, *xp; } dec_bufs;

static void norm(const int64_t *ld, int field, const float *x, float *residual, int64_t rows,
                 int64_t n, float *out, int nthreads) {
    tm_rms_norm(x, residual, (const float *)ld[field], ld_float(ld[LD_EPS]), (int)ld[LD_GEMMA],
                rows, n, out, nthreads);
}

/* q and k heads of each token normalised in place (Qwen3, Gemma 3): the module normalises
 * a copy of the same rows with the same kernel. */
static void qk_norm(const int64_t *ld, const dec_step *s, float *qkv) {
    const int64_t nqkv = (s->Hq + 2 * s->Hkv) * s->D;
    for (int64_t t = 0; t < s->T; t++) {
        float *q = qkv + t * nqkv, *k = q + s->Hq * s->D;
        norm(ld, LD_Q_NORM, q, NULL, s->Hq, s->D, q, s->nthreads);
        norm(ld, LD_K_NORM, k, NULL, s->Hkv, s->D, k, s->nthreads);
    }
}

static const float *bias(const int64_t *ld, int field) { return (const float *)ld[field]; }

/* x's attention half up to the o projection: w->h = o. Returns 1 if attention, 2 if the q8
 * kernel, could not allocate its buffer. */
static int attention(const int64_t *ld, const int64_t *lkv, const dec_step *s, const float *x,
                     void *kc, void *vc, float *ks, float *vs, const dec_bufs *w) {
    const int64_t *slots = (const int64_t *)lkv[LKV_SLOTS];
    const int64_t *block_tables = (const int64_t *)lkv[LKV_TABLES];
    const int64_t *lin = (const int64_t *)ld[LD_LINEARS], per_linear = DEC_PARTS * DEC_FIELDS;
    const int64_t nqkv = (s->Hq + 2 * s->Hkv) * s->D, qd = s->Hq * s->D;
    norm(ld, LD_NORM_IN, x, NULL, s->T, s->H, w->h, s->nthreads);
    if (dec_linear(lin, bias(ld, LD_BIAS_QKV), w->h, s->T, s->H, nqkv, w->qkv, w->tmp, w->xp,
                   s->q8, s->nthreads))
        return 2;
    if (ld[LD_Q_NORM]) qk_norm(ld, s, w->qkv);
    tm_rope(w->qkv, w->qkv + qd, s->T, s->Hq, s->Hkv, s->D, nqkv, nqkv, (const float *)ld[LD_COS],
            (const float *)ld[LD_SIN], s->pos);
    write_kv(w->qkv, s->T, s->Hq, s->Hkv, s->D, slots, kc, vc, ks, vs, s->kv_dt);
    if (tm_paged_attention(w->qkv, nqkv, s->Hq, s->D, kc, vc, ks, vs, s->kv_dt, s->bs, s->Hkv,
                           block_tables, lkv[LKV_TABLE_STRIDE], s->B, s->q_start, s->q_len, s->seq_len,
                           s->q_pos, ld_float(ld[LD_SCALE]), ld[LD_WINDOW], w->att, s->nthreads))
        return 1;
    return dec_linear(lin + per_linear, bias(ld, LD_BIAS_O), w->att, s->T, qd, s->H, w->h, w->tmp,
                      w->xp, s->q8, s->nthreads) ? 2 : 0;
}

/* The gated MLP of h2: w->h = down(act(gate) * up). Returns 2 if the q8 kernel could not
 * allocate its buffer. */
static int mlp(const int64_t *ld, const dec_step *s, const dec_bufs *w) {
    const int64_t *lin = (const int64_t *)ld[LD_LINEARS], per_linear = DEC_PARTS * DEC_FIELDS;
    if (dec_linear(lin + 2 * per_linear, bias(ld, LD_BIAS_GATE_UP), w->h2, s->T, s->H, 2 * s->I,
                   w->gu, w->tmp, w->xp, s->q8, s->nthreads))
        return 2;
    if (ld[LD_ACT] == DEC_ACT_GELU_TANH) tm_gelu_tanh_mul(w->gu, s->T, s->I, w->act, s->nthreads);
    else tm_silu_mul(w->gu, s->T, s->I, w->act, s->nthreads);
    return dec_linear(lin + 3 * per_linear, bias(ld, LD_BIAS_DOWN), w->act, s->T, s->I, s->H, w->h,
                      w->tmp, w->xp, s->q8, s->nthreads) ? 2 : 0;
}

static void add_rows(float *x, const float *y, int64_t n) {   /* the module path's x + y */
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* The residual add of the attention output w->h and the FFN's input norm: w->h2. */
static void attention_residual(const int64_t *ld, const dec_step *s, float *x, const dec_bufs *w) {
    if (!ld[LD_NORM_PRE_FFN]) {   /* x += h, then norm: one fused kernel, as add_and_norm */
        norm(ld, LD_NORM_POST_ATTN, w->h, x, s->T, s->H, w->h2, s->nthreads);
        return;
    }
    norm(ld, LD_NORM_POST_ATTN, w->h, NULL, s->T, s->H, w->h2, s->nthreads);
    add_rows(x, w->h2, s->T * s->H);
    norm(ld, LD_NORM_PRE_FFN, x, NULL, s->T, s->H, w->h2, s->nthreads);
}

/* The FFN output w->h into the residual stream, through the post-FFN norm where there is one. */
static void ffn_residual(const int64_t *ld, const dec_step *s, float *x, const dec_bufs *w) {
    if (ld[LD_NORM_POST_FFN]) {
        norm(ld, LD_NORM_POST_FFN, w->h, NULL, s->T, s->H, w->h2, s->nthreads);
        add_rows(x, w->h2, s->T * s->H);
    } else {
        add_rows(x, w->h, s->T * s->H);
    }
}

static dec_bufs carve(float *scratch, const dec_step *s) {
    const int64_t T = s->T, nqkv = (s->Hq + 2 * s->Hkv) * s->D, two_i = 2 * s->I;
    const int64_t tmp_cols = nqkv > two_i ? (nqkv > s->H ? nqkv : s->H) : (two_i > s->H ? two_i : s->H);
    dec_bufs w;
    w.h = scratch; w.h2 = w.h + T * s->H; w.qkv = w.h2 + T * s->H; w.att = w.qkv + T * nqkv;
    w.gu = w.att + T * s->Hq * s->D; w.act = w.gu + T * two_i; w.tmp = w.act + T * s->I;
    w.xp = w.tmp + T * tmp_cols;
    return w;
}

/* x [T, H] through L layers (layers: L rows of LD_FIELDS; layer_kv: L rows of LKV_FIELDS).
 * Caches: arrays of L addresses;
 * kv_dt: their value type (KV_F32 / KV_F16 / KV_BF16, or KV_I8 with k_scales / v_scales,
 * else NULL: L addresses of per-slot scales). scratch holds T * (2H + Q + Hq D + 3I +
 * max(Q, 2I, H) + max(H, Hq D, I)) floats, Q = (Hq + 2Hkv) D. q_pos: NULL, or each row's
 * attention position when the step verifies draft trees (tm_paged_attention's q_pos; the
 * RoPE positions pos then hold the same values). q8: int8 / int4 linears take
 * int8-rounded activations (tm_qmm_q8). ffn_in: NULL, or [T, H] floats that receive the
 * FFN's normed input instead of running the FFN (MoE layers: the caller runs its experts
 * on it and adds them to x). Returns 1 if attention, 2 if the q8 kernel, could not
 * allocate its buffer. */
int tm_llama_decode(float *x, int64_t T, int64_t H, int64_t L, const int64_t *layers,
                    const int64_t *k_caches, const int64_t *v_caches,
                    const int64_t *k_scales, const int64_t *v_scales, int kv_dt,
                    int64_t Hq, int64_t Hkv, int64_t D, int64_t I, const int64_t *pos,
                    int64_t bs, const int64_t *layer_kv, int64_t B, const int64_t *q_start,
                    const int64_t *q_len, const int64_t *seq_len, const int64_t *q_pos,
                    float *scratch, float *ffn_in, int q8, int nthreads,
                    float *aux, const int64_t *aux_col, int64_t n_aux) {
    /* aux [T, n_aux * H] (or NULL): after layer l, column block aux_col[l] >= 0 gets a copy of
     * x, so a drafter's layer features need no call of their own (no copy: aux_col[l] < 0) */
    const dec_step s = {T, H, Hq, Hkv, D, I, pos, q_start, q_len, seq_len, q_pos, bs, B, kv_dt,
                        q8, nthreads};
    const dec_bufs w = carve(scratch, &s);
    for (int64_t l = 0; l < L; l++) {
        const int64_t *ld = layers + l * LD_FIELDS;
        float *ks = k_scales ? (float *)k_scales[l] : NULL, *vs = v_scales ? (float *)v_scales[l] : NULL;
        const int failed = attention(ld, layer_kv + l * LKV_FIELDS, &s, x, (void *)k_caches[l],
                                     (void *)v_caches[l], ks, vs, &w);
        if (failed) return failed;
        attention_residual(ld, &s, x, &w);
        if (ffn_in) {
            memcpy(ffn_in, w.h2, sizeof(float) * (size_t)(T * H));
            continue;
        }
        if (mlp(ld, &s, &w)) return 2;
        ffn_residual(ld, &s, x, &w);
        if (aux && aux_col[l] >= 0)
            for (int64_t r = 0; r < T; r++)
                memcpy(aux + (r * n_aux + aux_col[l]) * H, x + r * H, sizeof(float) * (size_t)H);
    }
    return 0;
}
