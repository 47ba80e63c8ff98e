/* Matmuls of int8 / int4 weights against int8-rounded (q8) activations on a tiled weight
 * copy: y[M, N] = q8(x)[M, K] @ W^T, with AVX-512 VNNI (512-bit registers) or AVX2 (two
 * 256-bit halves, bit-identical). Included at the end of qmm.c; it reuses qmm.c's activation
 * rounding (tm_quantize_q8) and group sums, so it computes what tm_qmm_q8 computes, in
 * another summation order.
 *
 * Why another kernel: tm_qmm_q8 walks one weight row at a time and ends every 32-value
 * block with a float multiply-add per row, so at prefill sizes it runs no faster than the
 * fp32 GEMM. Here the weights are re-laid out (qgemm.py, at load) so that the sixteen 32-bit
 * lanes of a register hold sixteen weight ROWS: one vpdpbusd takes four values of the same
 * 32-value block of 16 rows against four activations broadcast to every lane, eight of them
 * finish the block, and a single conversion and multiply-add per 16 rows applies the
 * block's scales. The outputs land in lanes as y[m, n .. n+15]: no horizontal sums.
 *
 * Tiled layout (t = n / 16 tile, b = 32-value block, j = row in tile = lane, s = step of 4
 * values in the block):
 *   i4: qw[t][b][p][j][4] uint8, p = 0..3: low nibble = value 4 * (2p) + byte, high nibble
 *       = value 4 * (2p + 1) + byte (the weight is the unsigned operand: q in 0..15)
 *   i8: qw[t][b][s][j][4] int8 = value 4s + byte (signed operand; activations go in as
 *       unsigned xq + 128, and corr[t][b][j] = -128 * sum of the block's 32 weights undoes it)
 *   sc[t][b][j] float32: the scale of row j's group holding block b
 *   mn[t][g][j] float32 (i4): row j's min of group g (w = sc * q + mn), times sum(x over g)
 * Rows past N are zero in every array (and their outputs are not stored).
 */
#include <immintrin.h>

#define QG_TILE 16   /* weight rows per tile: one per 32-bit lane */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QG_MT 8      /* activation rows per pass over a tile */

/* mb (compile-time 1..QG_MT) activation rows against tile t, every block of K. */
INLINE void qgemm_tile(const int8_t *xq, const float *dx, const float *xsum, const int mb,
                       int64_t K, int64_t G, int kind, const uint8_t *qw, const float *sc,
                       const float *mn, const int32_t *corr, int64_t N, int64_t t, float *y) {
    const int64_t nb = K / 32, per_g = G / 32, ngroups = K / G;
    const int i4 = kind == 1;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[QG_MT];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[QG_MT];
        const __m512i init = i4 ? _mm512_setzero_si512() : _mm512_loadu_si512(corr + (t * nb + b) * QG_TILE);
        for (int m = 0; m < mb; m++) dot[m] = init;
        const int8_t *xb = xq + b * 32;
        if (i4) {
            const uint8_t *wb = qw + (t * nb + b) * 256;
            for (int p = 0; p < 4; p++) {
                __m512i raw = _mm512_loadu_si512(wb + 64 * p);
                __m512i w0 = _mm512_and_si512(raw, low);
                __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                for (int m = 0; m < mb; m++) {
                    const int8_t *xm = xb + m * K + 8 * p;
                    dot[m] = _mm512_dpbusd_epi32(dot[m], w0, _mm512_set1_epi32(*(const int32_t *)xm));
                    dot[m] = _mm512_dpbusd_epi32(dot[m], w1, _mm512_set1_epi32(*(const int32_t *)(xm + 4)));
                }
            }
        } else {
            const uint8_t *wb = qw + (t * nb + b) * 512;
            for (int s = 0; s < 8; s++) {
                __m512i w = _mm512_loadu_si512(wb + 64 * s);
                for (int m = 0; m < mb; m++)   /* xq here holds xq + 128 (unsigned) */
                    dot[m] = _mm512_dpbusd_epi32(dot[m], _mm512_set1_epi32(*(const int32_t *)(xb + m * K + 4 * s)), w);
            }
        }
        const __m512 s_vec = _mm512_loadu_ps(sc + (t * nb + b) * QG_TILE);
        for (int m = 0; m < mb; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]),
                                     _mm512_mul_ps(s_vec, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
        if (i4 && (b + 1) % per_g == 0) {   /* the affine term of the group just finished */
            const int64_t g = b / per_g;
            const __m512 mn_vec = _mm512_loadu_ps(mn + (t * ngroups + g) * QG_TILE);
            for (int m = 0; m < mb; m++)
                acc[m] = _mm512_fmadd_ps(mn_vec, _mm512_set1_ps(xsum[m * ngroups + g]), acc[m]);
        }
    }
    const int64_t n0 = t * QG_TILE, left = N - n0;
    const __mmask16 keep = left >= QG_TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int m = 0; m < mb; m++) _mm512_mask_storeu_ps(y + m * N + n0, keep, acc[m]);
}
#else
#define QG_MT 4      /* 16 ymm registers: 4 rows x (sum + block dot) plus weights */

/* AVX2: the same tiles as two halves of 8 rows (one ymm lane each), vpmaddubsw + vpmaddwd
 * for each vpdpbusd. int8 weights take the sign trick (|w| unsigned, x with w's sign:
 * xu * w would overflow vpmaddubsw's int16 pairs), so xq stays signed and corr is unused.
 * Every lane sums the same integers and then runs the same float operations in the same
 * order as the VNNI build: the two builds' outputs are bit-identical. */
INLINE void qgemm_tile(const int8_t *xq, const float *dx, const float *xsum, const int mb,
                       int64_t K, int64_t G, int kind, const uint8_t *qw, const float *sc,
                       const float *mn, const int32_t *corr, int64_t N, int64_t t, float *y) {
    (void)corr;
    const int64_t nb = K / 32, per_g = G / 32, ngroups = K / G;
    const int i4 = kind == 1;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {   /* rows 8h .. 8h + 7 of the tile */
        __m256 acc[QG_MT];
        for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i dot[QG_MT];
            for (int m = 0; m < mb; m++) dot[m] = _mm256_setzero_si256();
            const int8_t *xb = xq + b * 32;
            if (i4) {
                const uint8_t *wb = qw + (t * nb + b) * 256 + 32 * h;
                for (int p = 0; p < 4; p++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + 64 * p));
                    __m256i w0 = _mm256_and_si256(raw, low);
                    __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int m = 0; m < mb; m++) {
                        const int8_t *xm = xb + m * K + 8 * p;
                        __m256i x0 = _mm256_set1_epi32(*(const int32_t *)xm);
                        __m256i x1 = _mm256_set1_epi32(*(const int32_t *)(xm + 4));
                        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
                        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
                    }
                }
            } else {
                const uint8_t *wb = qw + (t * nb + b) * 512 + 32 * h;
                for (int s = 0; s < 8; s++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 64 * s));
                    __m256i wu = _mm256_sign_epi8(w, w);
                    for (int m = 0; m < mb; m++) {
                        __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(xb + m * K + 4 * s)), w);
                        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), ones));
                    }
                }
            }
            const __m256 s_vec = _mm256_loadu_ps(sc + (t * nb + b) * QG_TILE + 8 * h);
            for (int m = 0; m < mb; m++)
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]),
                                         _mm256_mul_ps(s_vec, _mm256_set1_ps(dx[m * nb + b])), acc[m]);
            if (i4 && (b + 1) % per_g == 0) {
                const int64_t g = b / per_g;
                const __m256 mn_vec = _mm256_loadu_ps(mn + (t * ngroups + g) * QG_TILE + 8 * h);
                for (int m = 0; m < mb; m++)
                    acc[m] = _mm256_fmadd_ps(mn_vec, _mm256_set1_ps(xsum[m * ngroups + g]), acc[m]);
            }
        }
        const int64_t n0 = t * QG_TILE + 8 * h, left = N - n0;
        for (int m = 0; m < mb; m++) {
            if (left >= 8) { _mm256_storeu_ps(y + m * N + n0, acc[m]); continue; }
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[m]);
            for (int64_t j = 0; j < left; j++) y[m * N + n0 + j] = tmp[j];
        }
    }
}
#endif

/* kind 0 = i8, 1 = i4 (tiled arrays as above); G a multiple of 32 dividing K. Returns
 * nonzero when a buffer could not be allocated (y untouched). */
int tm_qgemm_q8(const float *x, int64_t M, int64_t K, int kind, const uint8_t *qw,
                const float *sc, const float *mn, const int32_t *corr, int64_t G, int64_t N,
                float *y, int nthreads) {
    const int64_t nb = K / 32, ngroups = K / G, tiles = (N + QG_TILE - 1) / QG_TILE;
    const int i4 = kind == 1;
    q8_input in;
    if (q8_prepare(x, M, K, G, i4, &in)) return 1;
    int8_t *xq = in.qx;
    const float *dx = in.dx, *xsum = in.xsum;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (!i4)   /* the unsigned operand: xq + 128 */
        for (int64_t i = 0; i < M * K; i++) xq[i] = (int8_t)((uint8_t)xq[i] ^ 0x80);
#endif
    /* tiles outside, row passes inside: a tile's weights (K/2 or K bytes x 16 rows) stay
     * in L1 while every pass of QG_MT activation rows reads them */
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t m0 = 0; m0 < M; m0 += QG_MT) {
            const int64_t mb = M - m0 < QG_MT ? M - m0 : QG_MT;
            const int8_t *xm = xq + m0 * K;
            const float *dm = dx + m0 * nb, *sm = i4 ? xsum + m0 * ngroups : NULL;
            float *ym = y + m0 * N;
            switch (mb) {   /* compile-time rows and kind per case: the loops unroll */
#define QG_CALL(R) if (i4) qgemm_tile(xm, dm, sm, R, K, G, 1, qw, sc, mn, corr, N, t, ym); \
                   else qgemm_tile(xm, dm, sm, R, K, G, 0, qw, sc, mn, corr, N, t, ym);
#define QG_CASE(R) case R: QG_CALL(R) break;
                QG_CASE(1) QG_CASE(2) QG_CASE(3)
#if QG_MT > 4
                QG_CASE(4) QG_CASE(5) QG_CASE(6) QG_CASE(7)
#endif
                default: QG_CALL(QG_MT)
#undef QG_CASE
#undef QG_CALL
            }
        }
    }
    q8_free(&in);
    return 0;
}
