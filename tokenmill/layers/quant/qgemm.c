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
 * Tiled layout (t = n / 16 tile, b = 32-value block, g = group, j = row in tile = lane,
 * s = step of 4 values in a block). The weight is the unsigned operand of every product:
 *   i4: qw[t][b][p][j][4] uint8, p = 0..3: low nibble = value 4 * (2p) + byte, high nibble
 *       = value 4 * (2p + 1) + byte (q in 0..15)
 *   i8: qw[t][b][s][j][4] uint8 = q + 128 of value 4s + byte; the VNNI build takes
 *       128 * (sum of the block's int8 activations) off each block's dot, the AVX2 build
 *       restores q (vpmaddubsw's int16 pairs cannot hold (q + 128) * x)
 *   i5 (QG_KIND_I5: int8 values of five bits, GGUF Q5_0 / Q5_1 / Q5_K): 320 bytes per block,
 *       the i4 layout of u's low nibbles (256 bytes), then the fifth-bit plane (64 bytes):
 *       byte j * 4 + i, bit r = bit 4 of u in byte (j, i) of nibble register r (2p for the
 *       low nibbles of step p, 2p + 1 for the high ones). One load serves the block's eight
 *       registers, and each takes its bits by a shift and a mask. u = q + 16 without mins
 *       (q in -16..15; both builds take 16 * the block's activation sum off its dot), u = q
 *       with them (0..31). 5.5 bits a weight with its scale instead of int8's 8.5
 *   sc[t][g][j]: row j's scale of group g; mn[t][g][j] (i4, i8 with mins): its min (w = sc * q + mn), times
 *       the exact float sum of x over the group. float32, or float16 (kind | KIND_HALF)
 *       where the checkpoint's own are (GGUF): converted exactly, half the bytes.
 * Rows past N are zero in every array (and their outputs are not stored).
 */
#include <immintrin.h>

#define QG_TILE 16   /* weight rows per tile: one per 32-bit lane */
#define QG_KIND_I5 3  /* tiled-only kind (| KIND_HALF): five-bit values, see above */
#define QG_I5_BYTES 320   /* bytes per block of a tile: 256 of nibbles, 64 of fifth bits */

/* The fifth-bit plane of an i5 tile block (wb: the block), 64 bytes. */
INLINE const uint8_t *qg_i5_plane(const uint8_t *wb) {
    return wb + 256;
}

/* Bytes of one 32-value block of a tile of this kind (i4, i5, i8). */
INLINE int64_t qg_block_bytes(int kind) {
    return (kind & 7) == 1 ? 256 : (kind & 7) == QG_KIND_I5 ? QG_I5_BYTES : 512;
}

/* Software prefetch of block b of tile t, TM_QG_PREFETCH bytes ahead in the thread's
 * stream of tiles (built in where native.py's build_flags says so). */
INLINE void qg_prefetch_block(const uint8_t *qw, int64_t t, int64_t nb, int64_t b, int kind) {
#ifdef TM_QG_PREFETCH
    const int64_t bw = qg_block_bytes(kind);
    const char *ahead = (const char *)(qw + (t * nb + b) * bw) + TM_QG_PREFETCH;
    for (int64_t l = 0; l < bw; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
#else
    (void)qw; (void)t; (void)nb; (void)b; (void)kind;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QG_MT 8      /* activation rows per pass over a tile */

/* u - q of the stored values, taken off each block's dot as offset * (activation block sum):
 * i8 stores q + 128 here, i5 without mins q + 16. */
INLINE int qg_offset(int kind, int has_mins) {
    return (kind & 7) == 1 ? 0 : (kind & 7) == QG_KIND_I5 ? (has_mins ? 0 : 16) : 128;
}

INLINE __m512 qg_load16(const float *p, int64_t i, int kind) {   /* 16 scales or mins */
    return (kind & KIND_HALF) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                              : _mm512_loadu_ps(p + i);
}

/* int8 steps s0 .. s1 - 1 of one block into dot[m] (the stored q + 128 against x). */
INLINE void qg_i8_steps(const uint8_t *wb, const int8_t *xb, int64_t K, const int mb, int s0,
                        int s1, __m512i *dot) {
    for (int s = s0; s < s1; s++) {
        __m512i w = _mm512_loadu_si512(wb + 64 * s);
        for (int m = 0; m < mb; m++)
            dot[m] = _mm512_dpbusd_epi32(dot[m], w, _mm512_set1_epi32(*(const int32_t *)(xb + m * K + 4 * s)));
    }
}

/* int8 weights with a scale per 16 values (GGUF Q6_K): steps 0-3 of a block hold values
 * 0..15 (group 2b), steps 4-7 values 16..31 (group 2b + 1): two dots per block, each
 * scaled by its group's 16 row scales. qsum: block sums of the int8 activations per 16. */
INLINE void qgemm_tile_g16(const int8_t *xq, const float *dx, const int32_t *qsum, const int mb,
                           int64_t K, int kind, const uint8_t *qw, const float *sc, int64_t N,
                           int64_t t, float *y, const int streamed) {
    (void)streamed;   /* as in qgemm_tile */
    const int64_t nb = K / 32, ngroups = K / 16;
    __m512 acc[QG_MT];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = qw + (t * nb + b) * 512;
        const int8_t *xb = xq + b * 32;
        for (int half = 0; half < 2; half++) {
            const int64_t g = 2 * b + half;
            const __m512 s_vec = qg_load16(sc, (t * ngroups + g) * QG_TILE, kind);
            __m512i dot[QG_MT];
            for (int m = 0; m < mb; m++) dot[m] = _mm512_set1_epi32(-128 * qsum[m * ngroups + g]);
            qg_i8_steps(wb, xb, K, mb, 4 * half, 4 * half + 4, dot);
            for (int m = 0; m < mb; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]),
                                         _mm512_mul_ps(s_vec, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
        }
    }
    const int64_t n0 = t * QG_TILE, left = N - n0;
    const __mmask16 keep = left >= QG_TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int m = 0; m < mb; m++) _mm512_mask_storeu_ps(y + m * N + n0, keep, acc[m]);
}

/* mb (compile-time 1..QG_MT) activation rows against tile t, every block of K. qsum: the
 * int8 activations' block sums (i8). */
INLINE void qgemm_tile(const int8_t *xq, const float *dx, const float *xsum, const int32_t *qsum,
                       const int mb, int64_t K, int64_t G, int kind, const uint8_t *qw,
                       const float *sc, const float *mn, int64_t N, int64_t t, float *y,
                       const int streamed) {
    (void)streamed;   /* the AVX2 build's choice; here every load is a whole line already */
    const int64_t nb = K / 32, per_g = G / 32, ngroups = K / G;
    const int i4 = (kind & 7) == 1, i5 = (kind & 7) == QG_KIND_I5;
    const int offset = qg_offset(kind, mn != NULL);
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    __m512 acc[QG_MT];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        const __m512 s_vec = qg_load16(sc, (t * ngroups + g) * QG_TILE, kind);
        for (int64_t b = g * per_g; b < (g + 1) * per_g; b++) {
            __m512i dot[QG_MT];
            for (int m = 0; m < mb; m++)
                dot[m] = offset ? _mm512_set1_epi32(-offset * qsum[m * nb + b]) : _mm512_setzero_si512();
            const int8_t *xb = xq + b * 32;
            qg_prefetch_block(qw, t, nb, b, kind);
            if (i4 || i5) {
                const uint8_t *wb = qw + (t * nb + b) * qg_block_bytes(kind);
                const __m512i plane = i5 ? _mm512_loadu_si512(qg_i5_plane(wb)) : _mm512_setzero_si512();
                for (int p = 0; p < 4; p++) {
                    __m512i raw = _mm512_loadu_si512(wb + 64 * p);
                    __m512i w0 = _mm512_and_si512(raw, low);
                    __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    if (i5) {   /* bit 2p / 2p + 1 of each plane byte: 16 more */
                        w0 = _mm512_mask_add_epi8(w0, _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(1 << (2 * p)))),
                                                  w0, fifth);
                        w1 = _mm512_mask_add_epi8(w1, _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(2 << (2 * p)))),
                                                  w1, fifth);
                    }
                    for (int m = 0; m < mb; m++) {
                        const int8_t *xm = xb + m * K + 8 * p;
                        dot[m] = _mm512_dpbusd_epi32(dot[m], w0, _mm512_set1_epi32(*(const int32_t *)xm));
                        dot[m] = _mm512_dpbusd_epi32(dot[m], w1, _mm512_set1_epi32(*(const int32_t *)(xm + 4)));
                    }
                }
            } else {
                qg_i8_steps(qw + (t * nb + b) * 512, xb, K, mb, 0, 8, dot);
            }
            for (int m = 0; m < mb; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]),
                                         _mm512_mul_ps(s_vec, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
        }
        if (mn) {   /* the affine term of the group */
            const __m512 mn_vec = qg_load16(mn, (t * ngroups + g) * QG_TILE, kind);
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
/* Streamed passes of at most this many rows take the software prefetch (where built in):
 * on Zen 3 it made 1-2 rows latency-bound no longer, while 4 rows are compute-bound and
 * lost to its extra loads (docs/bench/2026-12-06d). */
#define QG_PREFETCH_ROWS 2

/* As the VNNI build's, except int8 rows: they restore q by the sign trick instead. */
INLINE int qg_offset(int kind, int has_mins) {
    return (kind & 7) == QG_KIND_I5 && !has_mins ? 16 : 0;
}

INLINE __m256 qg_load8(const float *p, int64_t i, int kind) {   /* 8 scales or mins */
    return (kind & KIND_HALF) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                              : _mm256_loadu_ps(p + i);
}

/* int8 step s of one block into dot[m] (q = stored byte - 128), by the sign trick: |q|
 * unsigned, x with q's sign. */
INLINE void qg_i8_step(const uint8_t *wb, const int8_t *xb, int64_t K, const int mb, int s,
                       __m256i *dot) {
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + 64 * s)), bias);
    __m256i wu = _mm256_sign_epi8(w, w);
    for (int m = 0; m < mb; m++) {
        __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(xb + m * K + 4 * s)), w);
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), ones));
    }
}

/* Steps s0 .. s1 - 1. */
INLINE void qg_i8_steps(const uint8_t *wb, const int8_t *xb, int64_t K, const int mb, int s0,
                        int s1, __m256i *dot) {
    if (mb == 1) {   /* fully unrolled: few registers live */
        for (int s = s0; s < s1; s++) qg_i8_step(wb, xb, K, mb, s, dot);
    } else {   /* several rows: unrolled by two only (fully unrolled, GCC hoisted every row's
                * broadcasts to the top of the block and spilled them to the stack) */
#pragma GCC unroll 2
        for (int s = s0; s < s1; s++) qg_i8_step(wb, xb, K, mb, s, dot);
    }
}

/* 0x10 in each byte whose bit r of the plane half is set, as src >> count, masked:
 * ``src`` is the plane shifted left by 4 for registers 0-3 (count r) and the plane itself
 * for 4-7 (count r - 4). The 16-bit shifts carry bits across bytes only into bits other
 * than bit 4. */
INLINE __m256i qg_fifth(__m256i src, const int count) {
    return _mm256_and_si256(_mm256_srli_epi16(src, count), _mm256_set1_epi8(0x10));
}

/* acc[m] -> y[m, n0 .. n0 + 7]; rows of the last tile past N are not stored. */
INLINE void qg_store8(float *y, int64_t N, int64_t n0, const int mb, const __m256 *acc) {
    const int64_t left = N - n0;
    for (int m = 0; m < mb; m++) {
        if (left >= 8) { _mm256_storeu_ps(y + m * N + n0, acc[m]); continue; }
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[m]);
        for (int64_t j = 0; j < left; j++) y[m * N + n0 + j] = tmp[j];
    }
}

/* Block b of half h (rows 8h .. 8h + 7 of tile t), int8 with a scale per 16 values, into acc. */
INLINE void qg16_half_block(const int8_t *xq, const float *dx, const int mb, int64_t K, int kind,
                            const uint8_t *qw, const float *sc, int64_t t, int64_t b, int h,
                            __m256 *acc) {
    const int64_t nb = K / 32, ngroups = K / 16;
    const uint8_t *wb = qw + (t * nb + b) * 512 + 32 * h;
    const int8_t *xb = xq + b * 32;
    for (int half = 0; half < 2; half++) {
        const __m256 s_vec = qg_load8(sc, (t * ngroups + 2 * b + half) * QG_TILE + 8 * h, kind);
        __m256i dot[QG_MT];
        for (int m = 0; m < mb; m++) dot[m] = _mm256_setzero_si256();
        qg_i8_steps(wb, xb, K, mb, 4 * half, 4 * half + 4, dot);
        for (int m = 0; m < mb; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]),
                                     _mm256_mul_ps(s_vec, _mm256_set1_ps(dx[m * nb + b])), acc[m]);
    }
}

/* AVX2 twin of the VNNI qgemm_tile_g16 (same integer sums, same float operations); both
 * halves of each block together when ``streamed``, as qgemm_tile_as does. */
INLINE void qgemm_tile_g16_as(const int8_t *xq, const float *dx, const int mb, int64_t K,
                              int kind, const uint8_t *qw, const float *sc, int64_t N, int64_t t,
                              float *y, const int streamed) {
    const int64_t nb = K / 32;
    if (streamed) {
        __m256 acc0[QG_MT], acc1[QG_MT];
        for (int m = 0; m < mb; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (mb <= QG_PREFETCH_ROWS) qg_prefetch_block(qw, t, nb, b, kind);
            qg16_half_block(xq, dx, mb, K, kind, qw, sc, t, b, 0, acc0);
            qg16_half_block(xq, dx, mb, K, kind, qw, sc, t, b, 1, acc1);
        }
        qg_store8(y, N, t * QG_TILE, mb, acc0);
        qg_store8(y, N, t * QG_TILE + 8, mb, acc1);
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[QG_MT];
        for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++)
            qg16_half_block(xq, dx, mb, K, kind, qw, sc, t, b, h, acc);
        qg_store8(y, N, t * QG_TILE + 8 * h, mb, acc);
    }
}

/* as qgemm_tile below: streamed a constant in each call */
INLINE void qgemm_tile_g16(const int8_t *xq, const float *dx, const int32_t *qsum, const int mb,
                           int64_t K, int kind, const uint8_t *qw, const float *sc, int64_t N,
                           int64_t t, float *y, const int streamed) {
    (void)qsum;
    if (streamed)
        qgemm_tile_g16_as(xq, dx, mb, K, kind, qw, sc, N, t, y, 1);
    else
        qgemm_tile_g16_as(xq, dx, mb, K, kind, qw, sc, N, t, y, 0);
}

/* The unsigned values of steps 2p (*w0) and 2p + 1 (*w1) of half h of an int4 / int5 tile
 * block: four values of each of the half's 8 rows per 32-bit lane. */
INLINE void qg_nibbles(const uint8_t *block, int h, int p, int i5, __m256i plane4, __m256i plane,
                       __m256i *w0, __m256i *w1) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * h + 64 * p));
    *w0 = _mm256_and_si256(raw, low);
    *w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    if (i5) {   /* registers 2p and 2p + 1 of this half's plane */
        const __m256i src = p < 2 ? plane4 : plane;
        if (p & 1) {
            *w0 = _mm256_or_si256(*w0, qg_fifth(src, 2));
            *w1 = _mm256_or_si256(*w1, qg_fifth(src, 3));
        } else {
            *w0 = _mm256_or_si256(*w0, qg_fifth(src, 0));
            *w1 = _mm256_or_si256(*w1, qg_fifth(src, 1));
        }
    }
}

/* The fifth-bit plane of half h of an int5 block, as it is and shifted left by 4 (qg_fifth). */
INLINE void qg_planes(const uint8_t *block, int h, __m256i *plane4, __m256i *plane) {
    *plane = _mm256_loadu_si256((const __m256i *)(qg_i5_plane(block) + 32 * h));
    *plane4 = _mm256_slli_epi16(*plane, 4);
}

/* Step p (values 8p .. 8p + 7) of half h of an int4 / int5 tile block for mb rows into
 * pairs[m], widened into dot[m] every 4 (i4) or 2 (i5) steps. vpmaddubsw's int16 pair sums are
 * added in int16, one vpmaddwd per widening instead of one per vpmaddubsw: |pair| <=
 * 2 * 15 * 127 (i4) or 2 * 31 * 127 (i5), so the eight of a block (i4) or four (i5) stay
 * below 2^15. The same exact integers as widening each one. */
INLINE void qg_nibble_step(const uint8_t *block, int h, int p, int i5, __m256i plane4, __m256i plane,
                           const int8_t *xb, int64_t K, const int mb, __m256i *pairs, __m256i *dot) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w0, w1;
    qg_nibbles(block, h, p, i5, plane4, plane, &w0, &w1);
    for (int m = 0; m < mb; m++) {
        const int8_t *xm = xb + m * K + 8 * p;
        const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)xm);
        const __m256i x1 = _mm256_set1_epi32(*(const int32_t *)(xm + 4));
        pairs[m] = _mm256_add_epi16(pairs[m], _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0),
                                                               _mm256_maddubs_epi16(w1, x1)));
    }
    if ((p + 1) % (i5 ? 2 : 4) == 0)
        for (int m = 0; m < mb; m++) {
            dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs[m], ones));
            pairs[m] = _mm256_setzero_si256();
        }
}

/* AVX2: the same tiles as two halves of 8 rows (one ymm lane each), vpmaddubsw + vpmaddwd
 * for each vpdpbusd; int8 weights by the sign trick (|q| unsigned, x with q's sign). Every
 * lane sums the same integers and then runs the same float operations in the same order
 * as the VNNI build: the two builds' outputs are bit-identical.
 *
 * Block b (of group g) of half h (rows 8h .. 8h + 7 of tile t) for mb activation rows into
 * acc: the integer dot, then one multiply-add by the scales. */
INLINE void qg_half_block(const int8_t *xq, const float *dx, const int32_t *qsum, const int mb,
                          int64_t K, int64_t ngroups, int kind, int offset, const uint8_t *qw,
                          const float *sc, int64_t t, int64_t g, int64_t b, int h, __m256 *acc) {
    const int64_t nb = K / 32;
    const int i4 = (kind & 7) == 1, i5 = (kind & 7) == QG_KIND_I5;
    const __m256 s_vec = qg_load8(sc, (t * ngroups + g) * QG_TILE + 8 * h, kind);
    const int8_t *xb = xq + b * 32;
    __m256i dot[QG_MT];
    for (int m = 0; m < mb; m++)
        dot[m] = offset ? _mm256_set1_epi32(-offset * qsum[m * nb + b]) : _mm256_setzero_si256();
    if (i4 || i5) {
        const uint8_t *block = qw + (t * nb + b) * qg_block_bytes(kind);
        __m256i pairs[QG_MT];   /* int16 pair sums not yet widened into dot */
        for (int m = 0; m < mb; m++) pairs[m] = _mm256_setzero_si256();
        __m256i plane = _mm256_setzero_si256(), plane4 = plane;
        if (i5) qg_planes(block, h, &plane4, &plane);
        if (mb == 1) {   /* fully unrolled: few registers live */
            for (int p = 0; p < 4; p++) qg_nibble_step(block, h, p, i5, plane4, plane, xb, K, mb, pairs, dot);
        } else if (i5) {   /* several rows: two steps at a time, so that the plane's
                            * shifts are constants */
#pragma GCC unroll 1
            for (int p = 0; p < 4; p += 2) {
                qg_nibble_step(block, h, p, i5, plane4, plane, xb, K, mb, pairs, dot);
                qg_nibble_step(block, h, p + 1, i5, plane4, plane, xb, K, mb, pairs, dot);
            }
        } else {   /* several rows of int4: not unrolled (fully unrolled, GCC hoisted every
                    * row's broadcasts to the top of the block and spilled them to the stack;
                    * two steps at a time ran 4 rows at 0.72x) */
#pragma GCC unroll 1
            for (int p = 0; p < 4; p++) qg_nibble_step(block, h, p, i5, plane4, plane, xb, K, mb, pairs, dot);
        }
    } else {
        qg_i8_steps(qw + (t * nb + b) * 512 + 32 * h, xb, K, mb, 0, 8, dot);
    }
    for (int m = 0; m < mb; m++)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]),
                                 _mm256_mul_ps(s_vec, _mm256_set1_ps(dx[m * nb + b])), acc[m]);
}

/* The affine term of group g (kinds with mins) of half h into acc. */
INLINE void qg_half_mins(const float *xsum, const int mb, int64_t ngroups, int kind,
                         const float *mn, int64_t t, int64_t g, int h, __m256 *acc) {
    const __m256 mn_vec = qg_load8(mn, (t * ngroups + g) * QG_TILE + 8 * h, kind);
    for (int m = 0; m < mb; m++)
        acc[m] = _mm256_fmadd_ps(mn_vec, _mm256_set1_ps(xsum[m * ngroups + g]), acc[m]);
}

/* mb rows against tile t. With ``streamed`` (rows for one pass: the tile comes from
 * memory once) both halves of each block run together, so each line of the tile is used
 * whole while in L1 and memory streams all the way: a half at a time, it idled through the
 * second half's pass, all cache hits (docs/bench/2026-12-06). Otherwise (several passes:
 * compute-bound) one half at a time, its accumulators held in registers. Each lane runs
 * the same operations in the same order either way. */
INLINE void qgemm_tile_as(const int8_t *xq, const float *dx, const float *xsum, const int32_t *qsum,
                          const int mb, int64_t K, int64_t G, int kind, const uint8_t *qw,
                          const float *sc, const float *mn, int64_t N, int64_t t, float *y,
                          const int streamed) {
    const int64_t per_g = G / 32, ngroups = K / G;
    const int offset = qg_offset(kind, mn != NULL);
    if (streamed) {
        __m256 acc0[QG_MT], acc1[QG_MT];
        for (int m = 0; m < mb; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ngroups; g++) {
            for (int64_t b = g * per_g; b < (g + 1) * per_g; b++) {
                if (mb <= QG_PREFETCH_ROWS) qg_prefetch_block(qw, t, K / 32, b, kind);
                qg_half_block(xq, dx, qsum, mb, K, ngroups, kind, offset, qw, sc, t, g, b, 0, acc0);
                qg_half_block(xq, dx, qsum, mb, K, ngroups, kind, offset, qw, sc, t, g, b, 1, acc1);
            }
            if (mn) {
                qg_half_mins(xsum, mb, ngroups, kind, mn, t, g, 0, acc0);
                qg_half_mins(xsum, mb, ngroups, kind, mn, t, g, 1, acc1);
            }
        }
        qg_store8(y, N, t * QG_TILE, mb, acc0);
        qg_store8(y, N, t * QG_TILE + 8, mb, acc1);
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[QG_MT];
        for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ngroups; g++) {
            for (int64_t b = g * per_g; b < (g + 1) * per_g; b++)
                qg_half_block(xq, dx, qsum, mb, K, ngroups, kind, offset, qw, sc, t, g, b, h, acc);
            if (mn)
                qg_half_mins(xsum, mb, ngroups, kind, mn, t, g, h, acc);
        }
        qg_store8(y, N, t * QG_TILE + 8 * h, mb, acc);
    }
}

/* streamed as a constant in each call: each order is compiled apart, its loops unrolled */
INLINE void qgemm_tile(const int8_t *xq, const float *dx, const float *xsum, const int32_t *qsum,
                       const int mb, int64_t K, int64_t G, int kind, const uint8_t *qw,
                       const float *sc, const float *mn, int64_t N, int64_t t, float *y,
                       const int streamed) {
    if (streamed)
        qgemm_tile_as(xq, dx, xsum, qsum, mb, K, G, kind, qw, sc, mn, N, t, y, 1);
    else
        qgemm_tile_as(xq, dx, xsum, qsum, mb, K, G, kind, qw, sc, mn, N, t, y, 0);
}

/* Several passes over an int4 / int5 tile (prefill chunks, batched decode): every pass
 * above takes the nibbles (and fifth bits) apart again, a quarter of an int5 pass's
 * instructions. Instead the tile is taken apart once into bytes, QG_UNPACKED_BYTES(K) of
 * them: per block and half, its eight steps' registers of unsigned values, and every pass
 * multiplies those. The same integer dots (exact, widened every four steps) and the same
 * float operations in the same order: the same bits. */
#define QG_UNPACKED_BYTES(K) ((K) * QG_TILE)

INLINE void qg_unpack_tile(const uint8_t *qw, int64_t t, int64_t nb, int kind, uint8_t *u) {
    const int i5 = (kind & 7) == QG_KIND_I5;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = qw + (t * nb + b) * qg_block_bytes(kind);
        for (int h = 0; h < 2; h++) {
            __m256i plane = _mm256_setzero_si256(), plane4 = plane, w0, w1;
            if (i5) qg_planes(block, h, &plane4, &plane);
            __m256i *out = (__m256i *)(u + (b * 2 + h) * 256);
            for (int p = 0; p < 4; p++) {
                qg_nibbles(block, h, p, i5, plane4, plane, &w0, &w1);
                _mm256_store_si256(out + 2 * p, w0);
                _mm256_store_si256(out + 2 * p + 1, w1);
            }
        }
    }
}

/* qg_half_block on an unpacked tile u. */
INLINE void qg_half_block_u(const int8_t *xq, const float *dx, const int32_t *qsum, const int mb,
                            int64_t K, int64_t ngroups, int kind, int offset, const uint8_t *u,
                            const float *sc, int64_t t, int64_t g, int64_t b, int h, __m256 *acc) {
    const int64_t nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 s_vec = qg_load8(sc, (t * ngroups + g) * QG_TILE + 8 * h, kind);
    const int8_t *xb = xq + b * 32;
    const __m256i *w = (const __m256i *)(u + (b * 2 + h) * 256);
    __m256i dot[QG_MT], pairs[QG_MT];
    for (int m = 0; m < mb; m++) {
        dot[m] = offset ? _mm256_set1_epi32(-offset * qsum[m * nb + b]) : _mm256_setzero_si256();
        pairs[m] = _mm256_setzero_si256();
    }
    /* |pair| <= 2 * 31 * 127: four steps' pairs stay below 2^15 */
#pragma GCC unroll 1
    for (int s0 = 0; s0 < 8; s0 += 4) {
        for (int s = s0; s < s0 + 4; s++) {
            const __m256i ws = _mm256_load_si256(w + s);
            for (int m = 0; m < mb; m++)
                pairs[m] = _mm256_add_epi16(pairs[m], _mm256_maddubs_epi16(
                    ws, _mm256_set1_epi32(*(const int32_t *)(xb + m * K + 4 * s))));
        }
        for (int m = 0; m < mb; m++) {
            dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs[m], ones));
            pairs[m] = _mm256_setzero_si256();
        }
    }
    for (int m = 0; m < mb; m++)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]),
                                 _mm256_mul_ps(s_vec, _mm256_set1_ps(dx[m * nb + b])), acc[m]);
}

/* qgemm_tile_as's several-pass order (one half at a time) on an unpacked tile u. */
INLINE void qgemm_tile_u(const int8_t *xq, const float *dx, const float *xsum, const int32_t *qsum,
                         const int mb, int64_t K, int64_t G, int kind, const uint8_t *u,
                         const float *sc, const float *mn, int64_t N, int64_t t, float *y) {
    const int64_t per_g = G / 32, ngroups = K / G;
    const int offset = qg_offset(kind, mn != NULL);
    for (int h = 0; h < 2; h++) {
        __m256 acc[QG_MT];
        for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ngroups; g++) {
            for (int64_t b = g * per_g; b < (g + 1) * per_g; b++)
                qg_half_block_u(xq, dx, qsum, mb, K, ngroups, kind, offset, u, sc, t, g, b, h, acc);
            if (mn)
                qg_half_mins(xsum, mb, ngroups, kind, mn, t, g, h, acc);
        }
        qg_store8(y, N, t * QG_TILE + 8 * h, mb, acc);
    }
}
#define QG_UNPACK 1
#endif

/* kind 0 = i8, 1 = i4, QG_KIND_I5, | KIND_HALF for float16 sc / mn (tiled arrays as
 * above); G a multiple of 32 dividing K, or 16 (i8). Returns nonzero when a buffer could not be
 * allocated (y untouched). */
int tm_qgemm_q8(const float *x, int64_t M, int64_t K, int kind, const uint8_t *qw,
                const float *sc, const float *mn, int64_t G, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / 32, ngroups = K / G, tiles = (N + QG_TILE - 1) / QG_TILE;
    const int g16 = G == 16;
    const int64_t sum_len = g16 ? 16 : 32, qstride = K / sum_len;   /* qsum entries per row */
    q8_input in;
    if (q8_prepare(x, M, K, G, mn != NULL, &in)) return 1;
    const int8_t *xq = in.qx;
    const float *dx = in.dx, *xsum = in.xsum;
    int32_t *qsum = NULL;
    if (qg_offset(kind, mn != NULL)) {   /* block (or group of 16) sums of the int8 activations: what the offset adds */
        qsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * qstride));
        if (!qsum) { q8_free(&in); return 1; }
        for (int64_t i = 0; i < M * qstride; i++) {
            int32_t v = 0;
            for (int j = 0; j < sum_len; j++) v += xq[i * sum_len + j];
            qsum[i] = v;
        }
    }
    /* tiles outside, row passes inside: a tile's weights (K/2 or K bytes x 16 rows) stay
     * in L1 while every pass of QG_MT activation rows reads them. One pass: the tile
     * streams from memory as it is used (the AVX2 build's qgemm_tile takes both halves) */
    const int streamed = M <= QG_MT;
#ifdef QG_UNPACK
    /* four passes or more over int4 / int5 tiles: each tile taken apart once
     * (qg_unpack_tile). Measured on Zen 3 (real Gemma 3 and Q4_1 tiles): 1.05-1.25x at
     * 13-512 rows; at 5-12 int4 lost up to 14 % (docs/bench/2026-12-06g) */
    const int unpack = M > 3 * QG_MT && !g16 && ((kind & 7) == 1 || (kind & 7) == QG_KIND_I5);
#endif
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef QG_UNPACK
    uint8_t *u = unpack ? (uint8_t *)aligned_alloc(32, (size_t)QG_UNPACKED_BYTES(K)) : NULL;
#endif
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
#ifdef QG_UNPACK
        if (u) {   /* (no buffer: the passes below take the tile apart as they go) */
            qg_unpack_tile(qw, t, nb, kind, u);
            for (int64_t m0 = 0; m0 < M; m0 += QG_MT) {
                const int64_t mb = M - m0 < QG_MT ? M - m0 : QG_MT;
                const int8_t *xm = xq + m0 * K;
                const float *dm = dx + m0 * nb, *sm = mn ? xsum + m0 * ngroups : NULL;
                const int32_t *qm = qsum ? qsum + m0 * qstride : NULL;
                float *ym = y + m0 * N;
                /* compile-time rows and kind per case, as below */
#define QG_U(R, KIND) qgemm_tile_u(xm, dm, sm, qm, R, K, G, KIND, u, sc, mn, N, t, ym)
#define QG_UK(R) switch (kind) { case 1: QG_U(R, 1); break; case QG_KIND_I5: QG_U(R, QG_KIND_I5); break; \
                                 case KIND_HALF | QG_KIND_I5: QG_U(R, KIND_HALF | QG_KIND_I5); break; \
                                 default: QG_U(R, KIND_HALF | 1); }
                switch (mb) { case 1: QG_UK(1) break; case 2: QG_UK(2) break;
                              case 3: QG_UK(3) break; default: QG_UK(QG_MT) }
#undef QG_UK
#undef QG_U
            }
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < M; m0 += QG_MT) {
            const int64_t mb = M - m0 < QG_MT ? M - m0 : QG_MT;
            const int8_t *xm = xq + m0 * K;
            const float *dm = dx + m0 * nb, *sm = mn ? xsum + m0 * ngroups : NULL;
            const int32_t *qm = qsum ? qsum + m0 * qstride : NULL;
            float *ym = y + m0 * N;
            switch (mb) {   /* compile-time rows and kind per case: the loops unroll */
#define QG_KIND(R, KIND) (g16 ? qgemm_tile_g16(xm, dm, qm, R, K, KIND, qw, sc, N, t, ym, streamed) \
                                 : qgemm_tile(xm, dm, sm, qm, R, K, G, KIND, qw, sc, mn, N, t, ym, streamed))
#define QG_CALL(R) switch (kind) { case 0: QG_KIND(R, 0); break; case 1: QG_KIND(R, 1); break; \
                                   case KIND_HALF: QG_KIND(R, KIND_HALF); break;            \
                                   case QG_KIND_I5: QG_KIND(R, QG_KIND_I5); break;          \
                                   case KIND_HALF | QG_KIND_I5:                             \
                                       QG_KIND(R, KIND_HALF | QG_KIND_I5); break;           \
                                   default: QG_KIND(R, KIND_HALF | 1); }
#define QG_CASE(R) case R: QG_CALL(R) break;
                QG_CASE(1) QG_CASE(2) QG_CASE(3)
#if QG_MT > 4
                QG_CASE(4) QG_CASE(5) QG_CASE(6) QG_CASE(7)
#endif
                default: QG_CALL(QG_MT)
#undef QG_CASE
#undef QG_CALL
#undef QG_KIND
            }
        }
    }
#ifdef QG_UNPACK
    free(u);
#endif
    }
    free(qsum);
    q8_free(&in);
    return 0;
}

/* Rows ids[0..n) of a tiled weight (kind & 7: 0 i8, 1 i4, QG_KIND_I5; tile_mins: the tiles
 * were built with mins, which sets an i5 tile's offset) as formats.dequantize_stored
 * computes them from the stored values: out[r][k] = float(q) * scale (+ min), the
 * product and the sum each rounded to float32 (no fused multiply-add). scales / mins: the
 * packed weight's own [N, K/G], float32 or float16 (half). A tied embedding reads its
 * rows here (quant/embedding.py): one call a step instead of a dozen tensor ops. Returns
 * nonzero (nothing written) if an id is outside [0, N). */
__attribute__((optimize("fp-contract=off")))
int tm_tiled_rows(const uint8_t *qw, int kind, int tile_mins, int64_t N, int64_t K,
                  const void *scales, const void *mins, int half, int64_t G,
                  const int64_t *ids, int64_t n, float *out) {
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= N) return 1;
    const int k7 = kind & 7;
    const int64_t nb = K / 32, ngroups = K / G;
    const int64_t bw = qg_block_bytes(kind);
    const int off5 = tile_mins ? 0 : 16;
    for (int64_t r = 0; r < n; r++) {
        const int64_t id = ids[r], t = id / QG_TILE, j = id % QG_TILE;
        float *o = out + r * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = qw + (t * nb + b) * bw;
            for (int v = 0; v < 32; v++) {
                const int s = v / 4, i = v % 4;   /* step of four values, byte in the step */
                int q;
                if (k7 == 0) {
                    q = (int)wb[s * 64 + j * 4 + i] - 128;
                } else {   /* step s = 2p + h: nibble h of byte (p, j, i) */
                    const uint8_t byte = wb[(s / 2) * 64 + j * 4 + i];
                    q = s % 2 ? byte >> 4 : byte & 0x0F;
                    if (k7 == QG_KIND_I5)   /* bit s of the plane's byte (j, i) */
                        q = (q | ((qg_i5_plane(wb)[j * 4 + i] >> s) & 1) << 4) - off5;
                }
                o[b * 32 + v] = (float)q;
            }
        }
        for (int64_t k = 0; k < K; k++) {
            const int64_t g = id * ngroups + k / G;
            const float sc = half ? _cvtsh_ss(((const uint16_t *)scales)[g]) : ((const float *)scales)[g];
            float w = o[k] * sc;
            if (mins) {
                const float mn = half ? _cvtsh_ss(((const uint16_t *)mins)[g]) : ((const float *)mins)[g];
                w = w + mn;
            }
            o[k] = w;
        }
    }
    return 0;
}
