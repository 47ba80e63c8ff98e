/* interleaved A/B of tm_qgemm_q8 from two libraries on one int8 (Q8_0-like, float16 scales)
 * matrix, one activation row: argv libA libB nthreads reps n k */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <dlfcn.h>
#include <time.h>
#include <immintrin.h>
typedef int (*qg_fn)(const float *, int64_t, int64_t, int, const uint8_t *, const float *, const float *, int64_t, int64_t, float *, int);
#include "q41_tiles.h"
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    qg_fn f[2];
    for (int i = 0; i < 2; i++) { void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); f[i] = (qg_fn)dlsym(h, "tm_qgemm_q8"); }
    int nt = atoi(argv[3]), reps = atoi(argv[4]); int64_t n = atoll(argv[5]), k = atoll(argv[6]);
    int64_t tiles = (n + 15) / 16, nb = k / 32;
    uint8_t *qw = aligned_alloc(64, tiles * nb * 512); uint16_t *sc = aligned_alloc(64, tiles * nb * 32 + 64);
    for (int64_t i = 0; i < tiles * nb * 512; i++) qw[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int64_t i = 0; i < tiles * nb * 16; i++) sc[i] = _cvtss_sh(0.01f, 0);
    float *x = malloc(k * 4), *y = malloc(n * 4);
    for (int i = 0; i < k; i++) x[i] = (float)((i * 37) % 101) / 101.f - 0.5f;
    double *ts[2] = {malloc(reps * 8), malloc(reps * 8)};
    for (int r = 0; r < reps; r++) for (int v = 0; v < 2; v++) {
        int w = (r & 1) ? 1 - v : v; double t = now();
        f[w](x, 1, k, 8, qw, (const float *)sc, NULL, 32, n, y, nt);
        ts[w][r] = now() - t;
    }
    for (int v = 0; v < 2; v++) { qsort(ts[v], reps, 8, cmp); printf("%s: min %.3f ms, median %.3f ms\n", v ? "B" : "A", ts[v][0] * 1e3, ts[v][reps / 2] * 1e3); }
    printf("B/A median %.3f\n", ts[1][reps / 2] / ts[0][reps / 2]);
}
