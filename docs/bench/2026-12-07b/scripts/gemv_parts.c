/* where a small Q4_1 GEMV's time goes at nthreads: whole call; the tile loop alone (input
 * prepared once); an empty parallel region. argv: nthreads n k */
#include <stdio.h>
#include KERNELS
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void tiles_only(const q8_input *in, int64_t K, const uint8_t *qw, const float *sc, const float *mn, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / 32, tiles = (N + 15) / 16, G = 32;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++)
        qgemm_tile(in->qx, in->dx, in->xsum, NULL, 1, K, G, 9, qw, sc, mn, N, t, y, 1);
    (void)nb;
}
static int call_hoisted(const float *x, int64_t K, const uint8_t *qw, const float *sc, const float *mn, int64_t N, float *y, int nthreads) {
    q8_input in;
    if (q8_prepare(x, 1, K, 32, 1, &in)) return 1;
    const int64_t tiles = (N + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++)
        qgemm_tile(in.qx, in.dx, in.xsum, NULL, 1, K, 32, 9, qw, sc, mn, N, t, y, 1);
    q8_free(&in);
    return 0;
}
int main(int argc, char **argv) {
    int nt = atoi(argv[1]); int64_t n = atoi(argv[2]), k = atoi(argv[3]); int iters = 20000;
    int64_t tiles = (n + 15) / 16, nb = k / 32;
    uint8_t *qw = aligned_alloc(64, tiles * nb * 256); uint16_t *sc = aligned_alloc(64, tiles * nb * 32 + 64), *mn = aligned_alloc(64, tiles * nb * 32 + 64);
    for (int64_t i = 0; i < tiles * nb * 256; i++) qw[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int64_t i = 0; i < tiles * nb * 16; i++) { sc[i] = _cvtss_sh(0.01f, 0); mn[i] = _cvtss_sh(-0.05f, 0); }
    float *x = malloc(k * 4), *y = malloc(n * 4);
    for (int i = 0; i < k; i++) x[i] = (float)((i * 37) % 101) / 101.f - 0.5f;
    double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9};
    q8_input in; q8_prepare(x, 1, k, 32, 1, &in);
    volatile int sink = 0;
    for (int r = 0; r < 5; r++) {
        double t = now();
        for (int i = 0; i < iters; i++) tm_qgemm_q8(x, 1, k, 9, qw, (const float *)sc, (const float *)mn, 32, n, y, nt);
        t = (now() - t) / iters; if (t < best[0]) best[0] = t;
        t = now();
        for (int i = 0; i < iters; i++) tiles_only(&in, k, qw, (const float *)sc, (const float *)mn, n, y, nt);
        t = (now() - t) / iters; if (t < best[1]) best[1] = t;
        t = now();
        for (int i = 0; i < iters; i++) call_hoisted(x, k, qw, (const float *)sc, (const float *)mn, n, y, nt);
        t = (now() - t) / iters; if (t < best[4]) best[4] = t;
        t = now();
        for (int i = 0; i < iters; i++) { q8_input j; q8_prepare(x, 1, k, 32, 1, &j); q8_free(&j); }
        t = (now() - t) / iters; if (t < best[2]) best[2] = t;
        t = now();
        for (int i = 0; i < iters; i++) {
            #pragma omp parallel num_threads(nt)
            { sink += 1; }
        }
        t = (now() - t) / iters; if (t < best[3]) best[3] = t;
    }
    printf("t%d %ldx%ld: call %.2f us, tile loop %.2f us, prepare %.2f us, empty region %.2f us, hoisted call %.2f us\n", nt, n, k, best[0]*1e6, best[1]*1e6, best[2]*1e6, best[3]*1e6, best[4]*1e6);
}
