/* A whole Llama-style decoder stack for decode-sized batches (1 to GEMV_MAX_M tokens) in
 * one call. In eager mode each layer costs ~10 Python module calls and ~10 kernel calls,
 * several milliseconds per step in all; here the same kernels run back to back in C, in
 * the same order on the same buffers, so the result is bit-identical to the module path
 * with the fused kernels on (tests/layers/test_cpu_decode.py compares them).
 *
 * Per layer l (x [T, H] is the residual stream, updated in place):
 *   h = rmsnorm(x) ; qkv = h Wqkv^T ; rope(q, k) ; cache[slots] = k, v
 *   att = paged_attention(q, cache) ; x += att Wo^T ; h2 = rmsnorm(x)
 *   x += (silu(h2 Wgate^T) * (h2 Wup^T)) Wdown^T
 * Norm weights and caches are arrays of L addresses. Each linear is described by
 * DEC_PARTS parts of DEC_FIELDS int64 each ({kind, weight, scale, mins, group, n}; kind -1 =
 * float32 weight [n, K], 0/1/2 = int8/int4/fp8 packed for tm_qmm, -2 = no part): the parts'
 * outputs are concatenated, as the Python linear methods do. linears holds L x 4 (qkv, o,
 * gate_up, down) such descriptors. scratch holds T * (2H + Q + Hq D + 3I + max(Q, 2I, H))
 * floats, Q = (Hq + 2Hkv) D. Returns nonzero if attention could not allocate its buffer. */
#define DEC_PARTS 4
#define DEC_FIELDS 6

/* y[T, ntot] = x[T, K] W^T over the parts of one linear; tmp: T * ntot floats. */
static void dec_linear(const int64_t *desc, const float *x, int64_t T, int64_t K, int64_t ntot,
                       float *y, float *tmp, int nthreads) {
    int64_t off = 0;
    const int single = desc[DEC_FIELDS] == -2;
    for (int p = 0; p < DEC_PARTS && desc[p * DEC_FIELDS] != -2; p++) {
        const int64_t *d = desc + p * DEC_FIELDS, kind = d[0], n = d[5];
        float *dst = single ? y : tmp;
        if (kind == -1)
            tm_linear_small_m(x, T, K, (const float *)d[1], n, NULL, dst, nthreads);
        else
            tm_qmm(x, T, K, (const uint8_t *)d[1], (const float *)d[2], (const float *)d[3],
                   d[4], n, (int)kind, dst, nthreads);
        if (!single)
            for (int64_t t = 0; t < T; t++)
                memcpy(y + t * ntot + off, tmp + t * n, sizeof(float) * (size_t)n);
        off += n;
    }
}

int tm_llama_decode(float *x, int64_t T, int64_t H, int64_t L,
                    const int64_t *ln1, const int64_t *ln2, const int64_t *linears,
                    const int64_t *k_caches, const int64_t *v_caches,
                    int64_t Hq, int64_t Hkv, int64_t D, int64_t I, float eps,
                    const float *cos, const float *sin, const int64_t *pos,
                    const int64_t *slots, int64_t bs, const int64_t *block_tables,
                    int64_t bt_stride, int64_t B, const int64_t *q_start,
                    const int64_t *q_len, const int64_t *seq_len, float scale,
                    float *scratch, int nthreads) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    float *h = scratch, *h2 = h + T * H, *qkv = h2 + T * H, *att = qkv + T * nqkv;
    float *gu = att + T * Hq * D, *act = gu + T * 2 * I, *tmp = act + T * I;
    const int64_t per_linear = DEC_PARTS * DEC_FIELDS;
    for (int64_t l = 0; l < L; l++) {
        float *kc = (float *)k_caches[l], *vc = (float *)v_caches[l];
        const int64_t *lin = linears + l * 4 * per_linear;
        tm_rms_norm(x, NULL, (const float *)ln1[l], eps, T, H, h, nthreads);
        dec_linear(lin, h, T, H, nqkv, qkv, tmp, nthreads);
        tm_rope(qkv, qkv + Hq * D, T, Hq, Hkv, D, nqkv, nqkv, cos, sin, pos);
        for (int64_t t = 0; t < T; t++) {
            memcpy(kc + slots[t] * kv_row, qkv + t * nqkv + Hq * D, sizeof(float) * (size_t)kv_row);
            memcpy(vc + slots[t] * kv_row, qkv + t * nqkv + (Hq + Hkv) * D, sizeof(float) * (size_t)kv_row);
        }
        if (tm_paged_attention(qkv, nqkv, Hq, D, kc, vc, NULL, NULL, bs, Hkv, block_tables,
                               bt_stride, B, q_start, q_len, seq_len, scale, 0, att, nthreads))
            return 1;
        dec_linear(lin + per_linear, att, T, Hq * D, H, h, tmp, nthreads);
        tm_rms_norm(h, x, (const float *)ln2[l], eps, T, H, h2, nthreads);   /* x += h */
        dec_linear(lin + 2 * per_linear, h2, T, H, 2 * I, gu, tmp, nthreads);
        tm_silu_mul(gu, T, I, act, nthreads);
        dec_linear(lin + 3 * per_linear, act, T, I, H, h, tmp, nthreads);
        for (int64_t i = 0; i < T * H; i++) x[i] += h[i];
    }
    return 0;
}
