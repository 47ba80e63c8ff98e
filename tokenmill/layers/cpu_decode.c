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
 * Weight and cache arguments are arrays of L addresses. scratch holds
 * T * (2H + (Hq + 2Hkv) D + Hq D + 3I) floats. Returns nonzero if attention could not
 * allocate its buffer. */

int tm_llama_decode(float *x, int64_t T, int64_t H, int64_t L,
                    const int64_t *ln1, const int64_t *wqkv, const int64_t *wo,
                    const int64_t *ln2, const int64_t *wgu, const int64_t *wd,
                    const int64_t *k_caches, const int64_t *v_caches,
                    int64_t Hq, int64_t Hkv, int64_t D, int64_t I, float eps,
                    const float *cos, const float *sin, const int64_t *pos,
                    const int64_t *slots, int64_t bs, const int64_t *block_tables,
                    int64_t bt_stride, int64_t B, const int64_t *q_start,
                    const int64_t *q_len, const int64_t *seq_len, float scale,
                    float *scratch, int nthreads) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    float *h = scratch, *h2 = h + T * H, *qkv = h2 + T * H, *att = qkv + T * nqkv;
    float *gu = att + T * Hq * D, *act = gu + T * 2 * I;
    for (int64_t l = 0; l < L; l++) {
        float *kc = (float *)k_caches[l], *vc = (float *)v_caches[l];
        tm_rms_norm(x, NULL, (const float *)ln1[l], eps, T, H, h, nthreads);
        tm_linear_small_m(h, T, H, (const float *)wqkv[l], nqkv, NULL, qkv, nthreads);
        tm_rope(qkv, qkv + Hq * D, T, Hq, Hkv, D, nqkv, nqkv, cos, sin, pos);
        for (int64_t t = 0; t < T; t++) {
            memcpy(kc + slots[t] * kv_row, qkv + t * nqkv + Hq * D, sizeof(float) * (size_t)kv_row);
            memcpy(vc + slots[t] * kv_row, qkv + t * nqkv + (Hq + Hkv) * D, sizeof(float) * (size_t)kv_row);
        }
        if (tm_paged_attention(qkv, nqkv, Hq, D, kc, vc, NULL, NULL, bs, Hkv, block_tables,
                               bt_stride, B, q_start, q_len, seq_len, scale, 0, att, nthreads))
            return 1;
        tm_linear_small_m(att, T, Hq * D, (const float *)wo[l], H, NULL, h, nthreads);
        tm_rms_norm(h, x, (const float *)ln2[l], eps, T, H, h2, nthreads);   /* x += h */
        tm_linear_small_m(h2, T, H, (const float *)wgu[l], 2 * I, NULL, gu, nthreads);
        tm_silu_mul(gu, T, I, act, nthreads);
        tm_linear_small_m(act, T, I, (const float *)wd[l], H, NULL, h, nthreads);
        for (int64_t i = 0; i < T * H; i++) x[i] += h[i];
    }
    return 0;
}
