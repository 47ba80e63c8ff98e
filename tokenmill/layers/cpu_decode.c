/* A whole Llama-style decoder stack for decode-sized batches (up to cpu_ops.LINEAR_MAX_ROWS
 * tokens) in one call. In eager mode each layer costs ~10 Python module calls and ~10 kernel calls,
 * several milliseconds per step in all; here the same kernels run back to back in C, in
 * the same order on the same buffers, so the result is bit-identical to the module path
 * with the fused kernels on (tests/models/test_llama_fused.py compares them).
 *
 * Per layer l (x [T, H] is the residual stream, updated in place):
 *   h = rmsnorm(x) ; qkv = h Wqkv^T ; rope(q, k) ; cache[slots] = k, v
 *   att = paged_attention(q, cache) ; x += att Wo^T ; h2 = rmsnorm(x)
 *   x += (silu(h2 Wgate^T) * (h2 Wup^T)) Wdown^T
 * Norm weights and caches are arrays of L addresses. Each linear is described by
 * DEC_PARTS parts of DEC_FIELDS int64 each ({kind, weight, scale, mins, group, n, perm,
 * tiled qw, tiled sc, tiled mn}; kind -1 = float32 weight [n, K], 0/1/2 =
 * int8/int4/fp8 packed for tm_qmm (| KIND_HALF: float16 scales), -2 = no part;
 * perm: 0 or an int64 [K] input-column order, GPTQ act-order; tiled: 0 or the part's copy
 * for tm_qgemm_q8, which q8 steps take, as matmul.py does): the parts' outputs are
 * concatenated, as the Python linear methods do. linears holds L x 4 (qkv, o, gate_up,
 * down) such descriptors. kv_dt: the caches' value type (KV_F32 / KV_F16 / KV_BF16, rows
 * rounded on write like torch's .to(), or KV_I8); k_scales / v_scales: NULL for float
 * caches, else L addresses of the per-slot scales of int8 caches (K/V quantized on write
 * like kv_quant.quantize_kv).
 * scratch holds T * (2H + Q + Hq D + 3I + max(Q, 2I, H) + max(H, Hq D, I)) floats,
 * Q = (Hq + 2Hkv) D. q8: int8 / int4 linears take int8-rounded activations (tm_qmm_q8).
 * ffn_in: NULL, or [T, H] floats that receive rmsnorm(x) after attention instead of running
 * the FFN (MoE layers: the caller runs its experts on it and adds them to x).
 * Returns 1 if attention, 2 if the q8 kernel, could not allocate its buffer. */
#include <float.h>

#define DEC_PARTS 4
#define DEC_TINY FLT_MIN   /* kv_quant._TINY: scale floor of an all-zero row */
#define DEC_FIELDS 10

/* y[T, ntot] = x[T, K] W^T over the parts of one linear; tmp: T * ntot floats, xp: T * K.
 * q8: int8 / int4 parts take int8-rounded activations (tm_qmm_q8), as matmul.py's q8 mode
 * does. Returns nonzero when the q8 kernel could not allocate its buffer. */
static int dec_linear(const int64_t *desc, const float *x, int64_t T, int64_t K, int64_t ntot,
                      float *y, float *tmp, float *xp, int q8, int nthreads) {
    int64_t off = 0;
    const int single = desc[DEC_FIELDS] == -2;
    for (int p = 0; p < DEC_PARTS && desc[p * DEC_FIELDS] != -2; p++) {
        const int64_t *d = desc + p * DEC_FIELDS, kind = d[0], n = d[5];
        const int64_t *perm = (const int64_t *)d[6];
        const float *in = x;
        float *dst = single ? y : tmp;
        if (perm) {   /* stored column order: x[:, perm] */
            for (int64_t t = 0; t < T; t++)
                for (int64_t k = 0; k < K; k++) xp[t * K + k] = x[t * K + perm[k]];
            in = xp;
        }
        if (kind == -1)
            tm_linear_small_m(in, T, K, (const float *)d[1], n, NULL, dst, nthreads);
        else if (q8 && d[7]) {   /* i8 / i4 with a tiled copy (scales of the part's dtype) */
            if (tm_qgemm_q8(in, T, K, (int)kind, (const uint8_t *)d[7], (const float *)d[8],
                            (const float *)d[9], d[4], n, dst, nthreads))
                return 1;
        }
        else if (q8 && ((kind & 7) == 0 || (kind & 7) == 1)) {   /* i8 / i4, maybe | KIND_HALF */
            if (tm_qmm_q8(in, T, K, (const uint8_t *)d[1], (const float *)d[2],
                          (const float *)d[3], d[4], n, (int)kind, dst, nthreads))
                return 1;
        } else
            tm_qmm(in, T, K, (const uint8_t *)d[1], (const float *)d[2], (const float *)d[3],
                   d[4], n, (int)kind, dst, nthreads);
        if (!single)
            for (int64_t t = 0; t < T; t++)
                memcpy(y + t * ntot + off, tmp + t * n, sizeof(float) * (size_t)n);
        off += n;
    }
    return 0;
}

/* int8 KV write of one [Hkv, D] row: per head scale = max(max|v| / 127, tiny), values
 * rounded half to even (the same float operations as kv_quant.quantize_kv). */
static void write_kv_i8(const float *v, int64_t Hkv, int64_t D, int8_t *dst, float *scale) {
    const float rounder = 12582912.0f;   /* 1.5 * 2^23 */
    for (int64_t h = 0; h < Hkv; h++) {
        const float *r = v + h * D;
        float amax = 0.0f;
        for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(r[d]));
        const float s = fmaxf(amax / 127.0f, DEC_TINY);
        scale[h] = s;
        for (int64_t d = 0; d < D; d++) {
            volatile float y = fminf(fmaxf(r[d] / s, -127.0f), 127.0f);
            y = y + rounder;
            y = y - rounder;
            dst[h * D + d] = (int8_t)y;
        }
    }
}

int tm_llama_decode(float *x, int64_t T, int64_t H, int64_t L,
                    const int64_t *ln1, const int64_t *ln2, const int64_t *linears,
                    const int64_t *k_caches, const int64_t *v_caches,
                    const int64_t *k_scales, const int64_t *v_scales, int kv_dt,
                    int64_t Hq, int64_t Hkv, int64_t D, int64_t I, float eps,
                    const float *cos, const float *sin, const int64_t *pos,
                    const int64_t *slots, int64_t bs, const int64_t *block_tables,
                    int64_t bt_stride, int64_t B, const int64_t *q_start,
                    const int64_t *q_len, const int64_t *seq_len, float scale,
                    float *scratch, float *ffn_in, int q8, int nthreads) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    float *h = scratch, *h2 = h + T * H, *qkv = h2 + T * H, *att = qkv + T * nqkv;
    float *gu = att + T * Hq * D, *act = gu + T * 2 * I, *tmp = act + T * I;
    const int64_t tmp_cols = nqkv > 2 * I ? (nqkv > H ? nqkv : H) : (2 * I > H ? 2 * I : H);
    float *xp = tmp + T * tmp_cols;
    const int64_t per_linear = DEC_PARTS * DEC_FIELDS;
    for (int64_t l = 0; l < L; l++) {
        void *kc = (void *)k_caches[l], *vc = (void *)v_caches[l];
        float *ks = k_scales ? (float *)k_scales[l] : NULL, *vs = v_scales ? (float *)v_scales[l] : NULL;
        const int64_t *lin = linears + l * 4 * per_linear;
        tm_rms_norm(x, NULL, (const float *)ln1[l], eps, 0, T, H, h, nthreads);
        if (dec_linear(lin, h, T, H, nqkv, qkv, tmp, xp, q8, nthreads)) return 2;
        tm_rope(qkv, qkv + Hq * D, T, Hq, Hkv, D, nqkv, nqkv, cos, sin, pos);
        for (int64_t t = 0; t < T; t++) {
            const float *kr = qkv + t * nqkv + Hq * D, *vr = kr + Hkv * D;
            if (ks) {
                write_kv_i8(kr, Hkv, D, (int8_t *)kc + slots[t] * kv_row, ks + slots[t] * Hkv);
                write_kv_i8(vr, Hkv, D, (int8_t *)vc + slots[t] * kv_row, vs + slots[t] * Hkv);
            } else {
                kv_store_row(kr, (void *)kv_at(kc, slots[t] * kv_row, kv_dt), kv_row, kv_dt);
                kv_store_row(vr, (void *)kv_at(vc, slots[t] * kv_row, kv_dt), kv_row, kv_dt);
            }
        }
        if (tm_paged_attention(qkv, nqkv, Hq, D, kc, vc, ks, vs, kv_dt, bs, Hkv, block_tables,
                               bt_stride, B, q_start, q_len, seq_len, scale, 0, att, nthreads))
            return 1;
        if (dec_linear(lin + per_linear, att, T, Hq * D, H, h, tmp, xp, q8, nthreads)) return 2;
        tm_rms_norm(h, x, (const float *)ln2[l], eps, 0, T, H, h2, nthreads);   /* x += h */
        if (ffn_in) {
            memcpy(ffn_in, h2, sizeof(float) * (size_t)(T * H));
            continue;
        }
        if (dec_linear(lin + 2 * per_linear, h2, T, H, 2 * I, gu, tmp, xp, q8, nthreads)) return 2;
        tm_silu_mul(gu, T, I, act, nthreads);
        if (dec_linear(lin + 3 * per_linear, act, T, I, H, h, tmp, xp, q8, nthreads)) return 2;
        for (int64_t i = 0; i < T * H; i++) x[i] += h[i];
    }
    return 0;
}
