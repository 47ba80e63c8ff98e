/* bf16 matmul of any row count for cpu_gemm_dtype="bfloat16" (CPUs with AVX-512 BF16 only;
 * the caller checks): x [M, K] float32 is rounded to bf16 as torch's .to() rounds
 * (nearest even, NaN -> 0x7fc0), W is a bf16 copy in tiles of 16 outputs, each tile [K / 2]
 * [16] pairs of consecutive k, so one 512-bit load feeds vdpbf16ps for 16 outputs and one
 * k pair. Every output is one chain over the k pairs in order (vdpbf16ps adds the odd
 * product, then the even one, rounding each sum to float32), then + bias: its bits depend
 * on its row alone, never on M or the rows beside it, so the fused decode stack and the
 * module path agree and a request's tokens do not change with the batch. Reference:
 * cpu_ops.linear_bf16_reference. */

#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define BF_MB 8   /* rows per block: 8 x 2 tiles = 16 accumulators */

/* float32 -> bf16 bits as c10::BFloat16's round_to_nearest_even: u + 0x7fff + lsb, NaN ->
 * 0x7fc0; n values, 16 at a time then the tail. */
BF_TARGET static void round_bf16(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i qnan = _mm512_set1_epi32(0x7fc0);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, bias),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(r));
    }
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        out[i] = x[i] != x[i] ? 0x7fc0 : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

/* Rows m0 .. m0 + MB - 1 against tiles t0 .. t0 + NT - 1 (compile-time MB, NT: the
 * accumulators stay in registers). xb: [M][K2] bf16 pairs, wt: tiles [K2][16] pairs. */
BF_TARGET static inline __attribute__((always_inline)) void
bf16_block(const uint32_t *xb, int64_t K2, const uint32_t *wt, int64_t t0, const int MB,
           const int NT, const float *bias, float *y, int64_t N) {
    __m512 acc[BF_MB][2];
    for (int m = 0; m < MB; m++)
        for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
    const uint32_t *w0 = wt + t0 * K2 * 16;
    for (int64_t p = 0; p < K2; p++) {
        __m512bh b[2];
        for (int t = 0; t < NT; t++)
            b[t] = (__m512bh)_mm512_loadu_si512((const void *)(w0 + (t * K2 + p) * 16));
        for (int m = 0; m < MB; m++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[m * K2 + p]);
            for (int t = 0; t < NT; t++) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, b[t]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int t = 0; t < NT; t++) {
            __m512 v = acc[m][t];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + (t0 + t) * 16));
            _mm512_storeu_ps(y + m * N + (t0 + t) * 16, v);
        }
}

/* y [M, N] = bf16(x) [M, K] bf16(W)^T (+ bias) with W as tiles (N % 16 == 0, K % 2 == 0;
 * cpu_ops.bf16_tiles lays them out), any M: rows go in panels of BF_PANEL, whose bf16 copy
 * stays in L2 while the threads pass their share of the tiles over it (W from L3 or memory
 * once a panel). Returns nonzero for a shape it does not take or when its buffer could not
 * be allocated. */
#define BF_PANEL 64
BF_TARGET int tm_linear_bf16(const float *x, int64_t M, int64_t K, const uint16_t *tiles,
                             int64_t N, const float *bias, float *y, int nthreads) {
    if (K % 2 || N % 16 || M <= 0) return 1;
    const int64_t K2 = K / 2, ntiles = N / 16, pairs = (ntiles + 1) / 2;
    uint32_t *xb = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(M * K2));
    if (!xb) return 1;
    const uint32_t *wt = (const uint32_t *)tiles;
    #pragma omp parallel num_threads(nthreads) if (pairs > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) round_bf16(x + r * K, K, (uint16_t *)(xb + r * K2));
        for (int64_t p0 = 0; p0 < M; p0 += BF_PANEL) {
            const int64_t p1 = M - p0 < BF_PANEL ? M : p0 + BF_PANEL;
            #pragma omp for schedule(static) nowait   /* panels write disjoint rows */
            for (int64_t tp = 0; tp < pairs; tp++) {
                const int64_t t0 = 2 * tp;
                const int two = t0 + 1 < ntiles;
                for (int64_t m0 = p0; m0 < p1; m0 += BF_MB) {
                    const int64_t mb = p1 - m0 < BF_MB ? p1 - m0 : BF_MB;
                    const uint32_t *xm = xb + m0 * K2;
                    float *ym = y + m0 * N;
#define BF_CASE(MBC) case MBC: if (two) bf16_block(xm, K2, wt, t0, MBC, 2, bias, ym, N); \
                               else bf16_block(xm, K2, wt, t0, MBC, 1, bias, ym, N); break;
                    switch (mb) {
                        BF_CASE(1) BF_CASE(2) BF_CASE(3) BF_CASE(4) BF_CASE(5) BF_CASE(6) BF_CASE(7)
                        default: BF_CASE(8)
                    }
#undef BF_CASE
                }
            }
        }
    }
    free(xb);
    return 0;
}
