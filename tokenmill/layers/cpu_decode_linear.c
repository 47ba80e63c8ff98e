/* The pieces of the fused decode stack (cpu_decode.c) that are not the layer's shape: a
 * linear layer from its descriptor, and the write of a token's K / V into the paged cache.
 *
 * A linear is described by DEC_PARTS parts of DEC_FIELDS int64 each ({kind, weight, scale,
 * mins, group, n, perm, tiled qw, tiled sc, tiled mn, tiled kind}; kind -1 = float32 weight
 * [n, K] (bf16 mode: tiled qw = its tm_linear_bf16 tiles, which every step takes, as
 * prepacked.linear takes them), -3 = 16-bit weight [n, K] of value type {field 2: KV_F16 / KV_BF16} for
 * tm_linear_half, 0/1/2 = int8/int4/fp8 packed for tm_qmm (| KIND_HALF: float16 scales), -2 = no
 * part; perm: 0 or an int64 [K] input-column order, GPTQ act-order; tiled: 0 or the part's
 * copy for tm_qgemm_q8 (its own kind: 5-bit tiles hold int8 values), which q8 steps take,
 * as matmul.py does): the parts' outputs are concatenated, as the Python linear methods do
 * (runner/fused_plan.py builds them). */
#include <float.h>

#define DEC_PARTS 4
#define DEC_FIELDS 11
#define DEC_TINY FLT_MIN   /* kv_quant._TINY: scale floor of an all-zero row */

/* One part: dst[T, n] = in[T, K] W^T through the kernel its module would call. */
static int dec_part(const int64_t *d, const float *in, int64_t T, int64_t K, const float *bias,
                    float *dst, int q8, int nthreads) {
    const int64_t kind = d[0], n = d[5];
    if (kind == -1 && d[7])   /* bf16 mode */
        return tm_linear_bf16(in, T, K, (const uint16_t *)d[7], n, bias, dst, nthreads);
    if (kind == -1) {   /* the float module adds its bias inside the kernel: so do we */
        tm_linear_small_m(in, T, K, (const float *)d[1], n, bias, dst, nthreads);
        return 0;
    }
    if (kind == -3) {   /* likewise the 16-bit weight's module */
        tm_linear_half(in, T, K, (const void *)d[1], (int)d[2], n, bias, dst, nthreads);
        return 0;
    }
    if (q8 && d[7])   /* i8 / i4 with a tiled copy (scales of the part's dtype) */
        return tm_qgemm_q8(in, T, K, (int)d[10], (const uint8_t *)d[7], (const float *)d[8],
                           (const float *)d[9], d[4], n, dst, nthreads);
    if (q8 && ((kind & 7) == 0 || (kind & 7) == 1))   /* i8 / i4, maybe | KIND_HALF */
        return tm_qmm_q8(in, T, K, (const uint8_t *)d[1], (const float *)d[2],
                         (const float *)d[3], d[4], n, (int)kind, dst, nthreads);
    tm_qmm(in, T, K, (const uint8_t *)d[1], (const float *)d[2], (const float *)d[3],
           d[4], n, (int)kind, dst, nthreads);
    return 0;
}

/* y[T, ntot] = x[T, K] W^T (+ bias [ntot]) over the parts of one linear; tmp: T * ntot
 * floats, xp: T * K. q8: int8 / int4 parts take int8-rounded activations (tm_qmm_q8), as
 * matmul.py's q8 mode does. A packed linear's bias is added after the parts are
 * concatenated, as PackedLinearMethod.apply adds it. Returns nonzero when the q8 kernel
 * could not allocate its buffer. */
static int dec_linear(const int64_t *desc, const float *bias, const float *x, int64_t T, int64_t K,
                      int64_t ntot, float *y, float *tmp, float *xp, int q8, int nthreads) {
    int64_t off = 0;
    const int single = desc[DEC_FIELDS] == -2, is_float = desc[0] == -1 || desc[0] == -3;
    for (int p = 0; p < DEC_PARTS && desc[p * DEC_FIELDS] != -2; p++) {
        const int64_t *d = desc + p * DEC_FIELDS, n = d[5];
        const int64_t *perm = (const int64_t *)d[6];
        const float *in = x;
        float *dst = single ? y : tmp;
        if (perm) {   /* stored column order: x[:, perm] */
            for (int64_t t = 0; t < T; t++)
                for (int64_t k = 0; k < K; k++) xp[t * K + k] = x[t * K + perm[k]];
            in = xp;
        }
        if (dec_part(d, in, T, K, is_float ? bias : NULL, dst, q8, nthreads)) return 1;
        if (!single)
            for (int64_t t = 0; t < T; t++)
                memcpy(y + t * ntot + off, tmp + t * n, sizeof(float) * (size_t)n);
        off += n;
    }
    if (bias && !is_float)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < ntot; j++) y[t * ntot + j] += bias[j];
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

/* Each token's k and v rows of qkv [T, (Hq + 2 Hkv) D] into its cache slot: float caches
 * rounded on write like torch's .to(), int8 ones (k_scale != NULL) quantized per head. */
static void write_kv(const float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                     const int64_t *slots, void *kc, void *vc, float *ks, float *vs, int kv_dt) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    for (int64_t t = 0; t < T; t++) {
        const float *kr = qkv + t * nqkv + Hq * D, *vr = kr + kv_row;
        if (ks) {
            write_kv_i8(kr, Hkv, D, (int8_t *)kc + slots[t] * kv_row, ks + slots[t] * Hkv);
            write_kv_i8(vr, Hkv, D, (int8_t *)vc + slots[t] * kv_row, vs + slots[t] * Hkv);
        } else {
            kv_store_row(kr, (void *)kv_at(kc, slots[t] * kv_row, kv_dt), kv_row, kv_dt);
            kv_store_row(vr, (void *)kv_at(vc, slots[t] * kv_row, kv_dt), kv_row, kv_dt);
        }
    }
}
