/* Register-blocked float32 matmul for batched decode: y[M, N] = x[M, K] W[N, K]^T (+ bias)
 * with the bits of the small-M kernel (cpu_ops.c, gemv_row_chain) at any M.
 *
 * Past a few rows a decode step is compute-bound, and streaming W once per 8 rows wastes
 * the FMA units on loads. Here a block of weight rows stays in L1 while every block of
 * activation rows passes over it, and each loaded value feeds several FMAs. The arithmetic
 * per output is exactly gemv_row_chain's: 8 lane chains over k (lane j sums k = j, j + 8, ...
 * in order, one FMA each), hsum256 of the 8 lanes, the K % 8 tail with fmaf, then the bias.
 * So a row's output does not depend on how many rows share the call (a verify step of
 * k + 1 rows per request gives what its decode steps would, at any batch size).
 *
 * AVX-512 build: a 512-bit accumulator holds two outputs (activation rows m and m + 1, same
 * weight row) as its two 256-bit halves. x is repacked per call so one load gives both rows'
 * 8 values; the weight's 8 values are broadcast to both halves (a load-port operation). A
 * block is GEMM_PAIRS pairs of rows x GEMM_NR weight rows: 24 accumulators, 11 loads per 24
 * FMAs, and the 8-lane sums of a pair's 8 outputs are added 16 at a time (gemm_hsum16).
 * AVX2 build: 256-bit accumulators, 3 rows x 4 weight rows (12 accumulators).
 *
 * Against oneDNN's prepacked GEMM on SmolLM2's shapes, W read from memory: ahead from 16
 * to 64 rows in the AVX-512 build, about even in the AVX2 one (oneDNN held to AVX2).
 *
 * 16-bit weights (dt KV_F16 / KV_BF16): each thread widens a block of weight rows into a
 * float32 copy of its own once, and the same block loop reads that copy: the bits of the
 * float32 kernel on the widened weight, with half the bytes read from memory. Rows come in
 * chunks of GEMM_CHUNK_ROWS, so the packed rows stay in L2 whatever M is (prefill). */

#define GEMM_CHUNK_ROWS 64

/* Rows [0, nr) of a weight block starting at w (value type dt, K per row) as float32 [nr, K]. */
static inline __attribute__((always_inline)) void
gemm_widen_rows_as(const void *w, const int dt, int64_t nr, int64_t K, float *dst) {
    const int64_t n = nr * K;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, kv_load16(w, i, dt));
#endif
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, kv_load8(w, i, dt));
    for (; i < n; i++) dst[i] = kv_load1(w, i, dt);
}

static void gemm_widen_rows(const void *w, int dt, int64_t nr, int64_t K, float *dst) {
    if (dt == KV_F16) gemm_widen_rows_as(w, KV_F16, nr, K, dst);
    else gemm_widen_rows_as(w, KV_BF16, nr, K, dst);
}

/* The weight block after rows [n0, n0 + nr) (block_rows rows a block, K values of esize
 * bytes a row, rows at `rows`): its first byte, and in *lines its whole 64-byte lines. Both
 * builds' blocked loops prefetch it into L2 while the current block computes, row block q of
 * n taking lines [q lines / n, (q + 1) lines / n), each share spread over its k steps: read
 * from memory in the first row block alone, a block waited on DRAM there (gate_up and the
 * head, whose W never stays cached; docs/bench/2026-12-07g and 2026-12-07h). */
static inline const char *gemm_next_block(const char *rows, int64_t N, int64_t n0, int64_t nr,
                                          int64_t block_rows, int64_t K, int64_t esize,
                                          int64_t *lines) {
    const int64_t next_rows = N - n0 - nr < block_rows ? N - n0 - nr : block_rows;
    *lines = next_rows * K * esize / 64;
    return rows + nr * K * esize;
}

#ifdef __AVX512F__
#define GEMM_PAIRS 3   /* pairs of activation rows per block (6 rows) */
#define GEMM_NR 8      /* weight rows per block: one vector of 16 sums per pair */

/* 8 floats into both 256-bit halves (AVX-512F has the 64-bit-lane form of the broadcast) */
static inline __m512 gemm_broadcast256(const float *src) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(src))));
}

static inline __m256 gemm_upper256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* Pack x [M, K] into [ceil(M/2)][K/8][2][8]: pair p's 8-value group kb is one 512-bit load.
 * An odd M's last pair is padded with a zero row (its outputs are never stored). */
static void gemm_pack_pairs(const float *x, int64_t M, int64_t K, float *xp) {
    const int64_t k8 = K / 8, pairs = (M + 1) / 2;
    for (int64_t p = 0; p < pairs; p++)
        for (int h = 0; h < 2; h++) {
            const int64_t m = 2 * p + h;
            for (int64_t kb = 0; kb < k8; kb++) {
                float *dst = xp + ((p * k8 + kb) * 2 + h) * 8;
                if (m < M) memcpy(dst, x + m * K + kb * 8, 8 * sizeof(float));
                else memset(dst, 0, 8 * sizeof(float));
            }
        }
}

/* The 16 sums of 8 accumulators (weight rows n0..n0+7, each holding rows m | m + 1) in
 * the order [m: n0..n7 | m + 1: n0..n7], each added exactly as hsum256 adds its 8 lanes:
 * ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), 16 outputs per vector operation. */
static inline __m512 gemm_hsum16(const __m512 *acc) {
    __m512 s4[4], s2[2];
    for (int i = 0; i < 4; i++) {   /* per 128-bit lane: v[i] + v[i + 4] of one output */
        const __m512 a = acc[2 * i], b = acc[2 * i + 1];
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    }
    for (int i = 0; i < 2; i++) {   /* s4[0] + s4[2], s4[1] + s4[3] */
        const __m512 u = s4[2 * i], v = s4[2 * i + 1];
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(u, v, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(u, v, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lanes now hold n0 n2 n4 n6 of m, of m + 1, then n1 n3 n5 n7 of m, of m + 1 */
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm512_permutexvar_ps(order, s);
}

/* Outputs of rows [2 p0, 2 p0 + 2 P) x weight rows [n0, n0 + NR), whose float32 values are
 * wb [NR, K]; P and NR are constants at each call site (gemm_block_p below), so the loops
 * unroll into registers. */
static inline __attribute__((always_inline)) void
gemm_block512(const float *x, const float *xp, int64_t M, int64_t K, int64_t p0, const int P,
              const float *wb, int64_t n0, const int NR, const float *bias, float *y, int64_t N,
              const char *pf, int64_t pf_lines) {
    const int64_t k8 = K / 8;
    __m512 acc[GEMM_PAIRS][GEMM_NR];
    for (int p = 0; p < P; p++)
        for (int j = 0; j < NR; j++) acc[p][j] = _mm512_setzero_ps();
    /* few live addresses (integer registers ran out and spilled): two weight-row bases
     * four rows apart and one x base, each stepped along k */
    const float *xb = xp + p0 * k8 * 16, *w0 = wb, *w4 = w0 + 4 * K;
    const int64_t xs = k8 * 16;
    int64_t pf_due = 0;   /* lines owed to the prefetch, in units of 1 / k8 */
    for (int64_t kb = 0; kb < k8; kb++, xb += 16, w0 += 8, w4 += 8) {
        __m512 xv[GEMM_PAIRS];
        for (int p = 0; p < P; p++) xv[p] = _mm512_loadu_ps(xb + p * xs);
        /* this row block's share of the next weight block, pf_lines / k8 lines a step
         * spread evenly: a burst of prefetches holds the fill buffers and stalls the loads
         * behind it (docs/bench/2026-12-07g: +13-16 % with W from memory) */
        for (pf_due += pf_lines; pf_due >= k8; pf_due -= k8, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        for (int j = 0; j < NR; j++) {
            __m512 wv = gemm_broadcast256((j < 4 ? w0 : w4) + (j & 3) * K);
            for (int p = 0; p < P; p++) acc[p][j] = _mm512_fmadd_ps(wv, xv[p], acc[p][j]);
        }
    }
    if (NR == GEMM_NR && k8 * 8 == K) {   /* full block: the sums 16 at a time */
        const __m256 b8 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
        const __m512 b16 = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(b8)));
        for (int p = 0; p < P; p++) {
            const int64_t m = 2 * (p0 + p);
            const __m512 s = _mm512_add_ps(gemm_hsum16(acc[p]), b16);
            _mm256_storeu_ps(y + m * N + n0, _mm512_castps512_ps256(s));
            if (m + 1 < M) _mm256_storeu_ps(y + (m + 1) * N + n0, gemm_upper256(s));
        }
        return;
    }
    for (int p = 0; p < P; p++)
        for (int h = 0; h < 2; h++) {
            const int64_t m = 2 * (p0 + p) + h;
            if (m >= M) continue;
            for (int j = 0; j < NR; j++) {
                const int64_t n = n0 + j;
                float s = hsum256(h ? gemm_upper256(acc[p][j]) : _mm512_castps512_ps256(acc[p][j]));
                for (int64_t kk = k8 * 8; kk < K; kk++) s = fmaf(wb[j * K + kk], x[m * K + kk], s);
                y[m * N + n] = s + (bias ? bias[n] : 0.0f);
            }
        }
}

static void gemm_block_p(const float *x, const float *xp, int64_t M, int64_t K, int64_t p0,
                         int P, const float *wb, int64_t n0, int NR, const float *bias, float *y,
                         int64_t N, const char *pf, int64_t pf_lines) {
#define GEMM_NR_CASES(PC) switch (NR) {                                                   \
        case 1: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 1, bias, y, N, pf, pf_lines); break;\
        case 2: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 2, bias, y, N, pf, pf_lines); break;\
        case 3: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 3, bias, y, N, pf, pf_lines); break;\
        case 4: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 4, bias, y, N, pf, pf_lines); break;\
        case 5: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 5, bias, y, N, pf, pf_lines); break;\
        case 6: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 6, bias, y, N, pf, pf_lines); break;\
        case 7: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 7, bias, y, N, pf, pf_lines); break;\
        default: gemm_block512(x, xp, M, K, p0, PC, wb, n0, 8, bias, y, N, pf, pf_lines); break; }
    switch (P) {
        case 1: GEMM_NR_CASES(1) break;
        case 2: GEMM_NR_CASES(2) break;
        default: GEMM_NR_CASES(3) break;
    }
#undef GEMM_NR_CASES
}

/* Rows [0, M <= GEMM_CHUNK_ROWS) against every weight row; xp: the rows' packed copy,
 * wide: nthreads float32 blocks of GEMM_NR x K (16-bit weights only). */
static void gemm_rows512(const float *x, int64_t M, int64_t K, const void *w, int dt, int64_t N,
                         const float *bias, float *y, int nthreads, float *xp, float *wide) {
    const int64_t pairs = (M + 1) / 2, nblocks = (N + GEMM_NR - 1) / GEMM_NR;
    const int64_t esize = kv_elem_bytes(dt), pblocks = (pairs + GEMM_PAIRS - 1) / GEMM_PAIRS;
    gemm_pack_pairs(x, M, K, xp);
    /* each thread owns a contiguous run of weight blocks: one stream of W per thread, each
     * block read from memory once and then from L1 by every block of rows */
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int t = 0; t < nthreads; t++) {
        float *own = wide + (int64_t)t * GEMM_NR * K;
        for (int64_t b = nblocks * t / nthreads; b < nblocks * (t + 1) / nthreads; b++) {
            const int64_t n0 = b * GEMM_NR;
            const int nr = (int)(N - n0 < GEMM_NR ? N - n0 : GEMM_NR);
            const char *rows = (const char *)w + n0 * K * esize;
            const float *wb = (const float *)rows;
            if (dt != KV_F32) { gemm_widen_rows(rows, dt, nr, K, own); wb = own; }
            int64_t lines;   /* the next block, into L2 meanwhile (gemm_next_block) */
            const char *next = gemm_next_block(rows, N, n0, nr, GEMM_NR, K, esize, &lines);
            for (int64_t q = 0; q < pblocks; q++) {
                const int64_t p0 = q * GEMM_PAIRS, l0 = q * lines / pblocks, l1 = (q + 1) * lines / pblocks;
                gemm_block_p(x, xp, M, K, p0, (int)(pairs - p0 < GEMM_PAIRS ? pairs - p0 : GEMM_PAIRS),
                             wb, n0, nr, bias, y, N, next + l0 * 64, l1 - l0);
            }
        }
    }
}

static void linear_blocked_as(const float *x, int64_t M, int64_t K, const void *w, int dt,
                              int64_t N, const float *bias, float *y, int nthreads) {
    const int64_t rows = M < GEMM_CHUNK_ROWS ? M : GEMM_CHUNK_ROWS;
    const size_t xp_floats = (size_t)(((rows + 1) / 2) * (K / 8) * 16);
    const size_t wide_floats = dt == KV_F32 ? 0 : (size_t)nthreads * GEMM_NR * (size_t)K;
    float *xp = (float *)aligned_alloc(64, ((xp_floats + wide_floats) * sizeof(float) + 63) / 64 * 64);
    if (!xp) {   /* no memory for the packed copies: the streaming kernel gives the same bits */
        gemv_row_slices(x, M, K, w, dt, N, bias, y, nthreads);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_CHUNK_ROWS)
        gemm_rows512(x + m0 * K, M - m0 < GEMM_CHUNK_ROWS ? M - m0 : GEMM_CHUNK_ROWS, K, w, dt, N,
                     bias, y + m0 * N, nthreads, xp, xp + xp_floats);
    free(xp);
}

#else   /* AVX2 build */
#define GEMM_MR 3   /* activation rows per block */
#define GEMM_NR 4   /* weight rows per block */

static inline __attribute__((always_inline)) void
gemm_block256(const float *x, int64_t K, int64_t m0, const int MR, const float *wb, int64_t n0,
              const int NR, const float *bias, float *y, int64_t N, const char *pf,
              int64_t pf_lines) {
    const int64_t k8 = K / 8;
    __m256 acc[GEMM_MR][GEMM_NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t pf_due = 0;   /* lines owed to the prefetch, in units of 1 / k8 (gemm_block512) */
    for (int64_t kb = 0; kb < k8; kb++) {
        __m256 xv[GEMM_MR];
        for (int i = 0; i < MR; i++) xv[i] = _mm256_loadu_ps(x + (m0 + i) * K + kb * 8);
        for (pf_due += pf_lines; pf_due >= k8; pf_due -= k8, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        for (int j = 0; j < NR; j++) {
            __m256 wv = _mm256_loadu_ps(wb + j * K + kb * 8);
            for (int i = 0; i < MR; i++) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            const int64_t m = m0 + i, n = n0 + j;
            float s = hsum256(acc[i][j]);
            for (int64_t kk = k8 * 8; kk < K; kk++) s = fmaf(wb[j * K + kk], x[m * K + kk], s);
            y[m * N + n] = s + (bias ? bias[n] : 0.0f);
        }
}

static void gemm_block_m(const float *x, int64_t K, int64_t m0, int MR, const float *wb,
                         int64_t n0, int NR, const float *bias, float *y, int64_t N,
                         const char *pf, int64_t pf_lines) {
#define GEMM_NR_CASES(MC) switch (NR) {                                                   \
        case 1: gemm_block256(x, K, m0, MC, wb, n0, 1, bias, y, N, pf, pf_lines); break;   \
        case 2: gemm_block256(x, K, m0, MC, wb, n0, 2, bias, y, N, pf, pf_lines); break;   \
        case 3: gemm_block256(x, K, m0, MC, wb, n0, 3, bias, y, N, pf, pf_lines); break;   \
        default: gemm_block256(x, K, m0, MC, wb, n0, 4, bias, y, N, pf, pf_lines); break; }
    switch (MR) {
        case 1: GEMM_NR_CASES(1) break;
        case 2: GEMM_NR_CASES(2) break;
        default: GEMM_NR_CASES(3) break;
    }
#undef GEMM_NR_CASES
}

static void linear_blocked_as(const float *x, int64_t M, int64_t K, const void *w, int dt,
                              int64_t N, const float *bias, float *y, int nthreads) {
    const int64_t nblocks = (N + GEMM_NR - 1) / GEMM_NR, esize = kv_elem_bytes(dt);
    float *wide = NULL;
    if (dt != KV_F32) {
        wide = (float *)aligned_alloc(64, ((size_t)nthreads * GEMM_NR * (size_t)K * sizeof(float) + 63) / 64 * 64);
        if (!wide) {   /* the streaming kernel gives the same bits */
            gemv_row_slices(x, M, K, w, dt, N, bias, y, nthreads);
            return;
        }
    }
    for (int64_t c0 = 0; c0 < M; c0 += GEMM_CHUNK_ROWS) {
        const int64_t c1 = M - c0 < GEMM_CHUNK_ROWS ? M : c0 + GEMM_CHUNK_ROWS;
        #pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int t = 0; t < nthreads; t++) {
            float *own = wide ? wide + (int64_t)t * GEMM_NR * K : NULL;
            for (int64_t b = nblocks * t / nthreads; b < nblocks * (t + 1) / nthreads; b++) {
                const int64_t n0 = b * GEMM_NR;
                const int nr = (int)(N - n0 < GEMM_NR ? N - n0 : GEMM_NR);
                const char *rows = (const char *)w + n0 * K * esize;
                const float *wb = (const float *)rows;
                if (own) { gemm_widen_rows(rows, dt, nr, K, own); wb = own; }
                /* the next block, into L2 meanwhile (gemm_next_block; without it W from
                 * memory ran 27 % below W cached on a Xeon, docs/bench/2026-12-07h) */
                int64_t lines;
                const char *next = gemm_next_block(rows, N, n0, nr, GEMM_NR, K, esize, &lines);
                const int64_t mblocks = (c1 - c0 + GEMM_MR - 1) / GEMM_MR;
                for (int64_t q = 0; q < mblocks; q++) {
                    const int64_t m0 = c0 + q * GEMM_MR, l0 = q * lines / mblocks, l1 = (q + 1) * lines / mblocks;
                    gemm_block_m(x, K, m0, (int)(c1 - m0 < GEMM_MR ? c1 - m0 : GEMM_MR), wb, n0, nr,
                                 bias, y, N, next + l0 * 64, l1 - l0);
                }
            }
        }
    }
    free(wide);
}
#endif

/* The float32 entry point (tests, benchmarks): any M through the blocked loop. */
void tm_linear_blocked(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y, int nthreads) {
    linear_blocked_as(x, M, K, w, KV_F32, N, bias, y, nthreads);
}
