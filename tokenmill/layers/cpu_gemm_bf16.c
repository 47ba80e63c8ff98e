/* bf16 matmul of any row count for cpu_gemm_dtype="bfloat16" (CPUs with AVX-512 BF16 only;
 * the caller checks): x [M, K] float32 is rounded to bf16 as torch's .to() rounds
 * (nearest even, NaN -> 0x7fc0), W is a bf16 copy in tiles of 16 outputs, each tile [K / 2]
 * [16] pairs of consecutive k, so one 512-bit load feeds vdpbf16ps for 16 outputs and one
 * k pair. Every output is one chain over the k pairs in order (vdpbf16ps adds the odd
 * product, then the even one, rounding each sum to float32), then + bias: its bits depend
 * on its row alone, never on M or the rows beside it, so the fused decode stack and the
 * module path agree and a request's tokens do not change with the batch. Reference:
 * cpu_ops.linear_bf16_reference. On a CPU with AMX-BF16 every call whose K % 32 == 0 takes
 * linear_bf16_amx below instead, at every M (its sums group differently: see there). */

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
static int tm_amx_on;
static int linear_bf16_amx(const float *x, int64_t M, int64_t K, const uint16_t *tiles,
                           int64_t N, const float *bias, float *y, int nthreads);
BF_TARGET int tm_linear_bf16(const float *x, int64_t M, int64_t K, const uint16_t *tiles,
                             int64_t N, const float *bias, float *y, int nthreads) {
    if (K % 2 || N % 16 || M <= 0) return 1;
    if (tm_amx_on && K % 32 == 0)   /* every row count: a row's bits never depend on M */
        return linear_bf16_amx(x, M, K, tiles, N, bias, y, nthreads);
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

/* The same product on AMX tiles (Sapphire Rapids and newer Intel CPUs): tdpbf16ps
 * multiplies a 16 x 32 bf16 block of x by a 32 x 16 block of W (one of bf16_tiles' tiles
 * over 16 k pairs is exactly AMX's B operand, rows of 16 pairs) into 16 x 16 float32 sums,
 * ~16x vdpbf16ps's products a cycle (1.2-2 TFLOP/s on 2 Xeon cores from 16 rows up, against
 * ~200 GFLOP/s for vdpbf16ps; at one or two rows 0.66-1.13x its time). Its sums, measured against
 * an emulation and as Intel's pseudo-code gives them: per 16 k pairs, the even products in
 * one float32 chain from zero and the odd ones in another, then acc += (even + odd) (denormal
 * inputs and outputs flushed to zero). cpu_ops.linear_bf16_reference has both kernels'
 * order. Rows go in blocks of 32 (two A tiles, zero rows past M; up to 16 rows, tiles of M
 * rows), outputs in pairs of W tiles: 4 accumulator tiles a block. Needs K % 32 == 0 and the
 * process's permission for tile data (tm_amx_enable). */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

static int tm_amx_on = 0;

/* Linux hands out AMX tile state only to a process that asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). on = 1: ask, and from then on tm_linear_bf16
 * takes the tiles where K % 32 == 0; returns nonzero when refused (nothing changes). on = 0:
 * back to vdpbf16ps (tests compare the two). native.py calls it once when the library is
 * opened on a CPU with AMX-BF16. */
int tm_amx_enable(int on) {
    if (on && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
        return 1;
    tm_amx_on = on != 0;
    return 0;
}

int tm_amx_active(void) { return tm_amx_on; }

struct amx_tilecfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* This thread's tiles: all eight 64 bytes wide; tiles 0-5 of ``rows`` rows (x and sums of
 * fewer than 16 rows), 6-7 of 16 (weights). */
AMX_TARGET static void amx_load_config(int rows) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = t >= 6 ? 16 : rows; }
    _tile_loadconfig(&cfg);
}

/* One block: rows m0 .. m0 + 16 * MT - 1 of xb ([Mpad][K] bf16) against W tiles t0 ..
 * t0 + NT - 1; sums go to y's rows below M (+ bias). Tiles 0-3 accumulate, 4-5 hold x,
 * 6-7 hold W. */
AMX_TARGET static inline __attribute__((always_inline)) void
amx_block(const uint16_t *xb, int64_t K, const uint32_t *wt, int64_t t0, const int MT,
          const int NT, const float *bias, float *y, int64_t N, int64_t m0, int64_t M) {
    const int64_t K2 = K / 2;
    const uint32_t *w0 = wt + t0 * K2 * 16, *w1 = w0 + K2 * 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t p = 0; p < K2; p += 16) {
        _tile_loadd(4, xb + m0 * K + 2 * p, K * 2);
        if (MT == 2) _tile_loadd(5, xb + (m0 + 16) * K + 2 * p, K * 2);
        _tile_loadd(6, w0 + p * 16, 64);
        if (NT == 2) _tile_loadd(7, w1 + p * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NT == 2) _tile_dpbf16ps(1, 4, 7);
        if (MT == 2) _tile_dpbf16ps(2, 5, 6);
        if (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    float c[4][16][16];
    _tile_stored(0, c[0], 64);
    if (NT == 2) _tile_stored(1, c[1], 64);
    if (MT == 2) _tile_stored(2, c[2], 64);
    if (MT == 2 && NT == 2) _tile_stored(3, c[3], 64);
    for (int mt = 0; mt < MT; mt++)
        for (int nt = 0; nt < NT; nt++) {
            const __m512 b = bias ? _mm512_loadu_ps(bias + (t0 + nt) * 16) : _mm512_setzero_ps();
            for (int r = 0; r < 16; r++) {
                const int64_t m = m0 + 16 * mt + r;
                if (m >= M) break;
                __m512 v = _mm512_loadu_ps(c[2 * mt + nt][r]);
                if (bias) v = _mm512_add_ps(v, b);
                _mm512_storeu_ps(y + m * N + (t0 + nt) * 16, v);
            }
        }
}

/* Rows per panel: its bf16 copy (rows x K x 2 bytes) stays in L2 (2 MB a core on Sapphire
 * Rapids) while the threads pass their W tiles over it. */
static int64_t amx_panel_rows(int64_t K) {
    int64_t rows = (int64_t)(512 * 1024) / (K * 2) / 32 * 32;
    return rows < 32 ? 32 : rows;
}

AMX_TARGET static int linear_bf16_amx(const float *x, int64_t M, int64_t K,
                                      const uint16_t *tiles, int64_t N, const float *bias,
                                      float *y, int nthreads) {
    const int64_t Mpad = (M + 31) / 32 * 32, ntiles = N / 16, pairs = (ntiles + 1) / 2;
    const int64_t panel = amx_panel_rows(K);
    uint16_t *xb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(Mpad * K));
    if (!xb) return 1;
    const uint32_t *wt = (const uint32_t *)tiles;
    #pragma omp parallel num_threads(nthreads) if (pairs > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < Mpad; r++) {
            if (r < M) round_bf16(x + r * K, K, xb + r * K);
            else memset(xb + r * K, 0, sizeof(uint16_t) * (size_t)K);
        }
        /* Up to 16 rows: x and sums in tiles of M rows (no work on zero rows). */
        amx_load_config(M < 16 ? (int)M : 16);
        for (int64_t p0 = 0; p0 < M; p0 += panel) {
            const int64_t p1 = M - p0 < panel ? M : p0 + panel;
            #pragma omp for schedule(static)   /* implicit barrier: the next panel reuses W */
            for (int64_t tp = 0; tp < pairs; tp++) {
                const int64_t t0 = 2 * tp;
                const int two = t0 + 1 < ntiles;
                for (int64_t m0 = p0; m0 < p1; m0 += 32) {
                    const int both = m0 + 16 < M;
                    if (both && two) amx_block(xb, K, wt, t0, 2, 2, bias, y, N, m0, M);
                    else if (both) amx_block(xb, K, wt, t0, 2, 1, bias, y, N, m0, M);
                    else if (two) amx_block(xb, K, wt, t0, 1, 2, bias, y, N, m0, M);
                    else amx_block(xb, K, wt, t0, 1, 1, bias, y, N, m0, M);
                }
            }
        }
        _tile_release();
    }
    free(xb);
    return 0;
}
