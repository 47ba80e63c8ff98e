/* interleaved A/B of tm_qgemm_q8 from two libraries: SmolLM2's 120 decode GEMVs of a step
 * (cold, distinct tiles), alternating A and B each step; min and median per library.
 * argv: libA libB nthreads steps [M] */
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
    for (int i = 0; i < 2; i++) { void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { printf("%s\n", dlerror()); return 1; } f[i] = (qg_fn)dlsym(h, "tm_qgemm_q8"); }
    int nt = atoi(argv[3]), steps = atoi(argv[4]); int64_t M = argc > 5 ? atoi(argv[5]) : 1;
    const int L = 30; int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    mat ms[L * 4];
    for (int l = 0; l < L; l++) for (int j = 0; j < 4; j++) ms[l * 4 + j] = make(shapes[j][0], shapes[j][1]);
    float *x = malloc(M * 1536 * 4), *y = malloc(M * 4000 * 4);
    for (int i = 0; i < M * 1536; i++) x[i] = (float)((i * 37) % 101) / 101.f - 0.5f;
    double *ts[2] = {malloc(steps * 8), malloc(steps * 8)};
    for (int s = 0; s < steps; s++) for (int v = 0; v < 2; v++) {
        int w = (s & 1) ? 1 - v : v;
        double t = now();
        for (int i = 0; i < L * 4; i++) f[w](x, M, ms[i].k, 9, ms[i].qw, (const float *)ms[i].sc, (const float *)ms[i].mn, 32, ms[i].n, y, nt);
        ts[w][s] = now() - t;
    }
    for (int v = 0; v < 2; v++) { qsort(ts[v], steps, 8, cmp); printf("%s: min %.3f ms, median %.3f ms\n", v ? "B" : "A", ts[v][0] * 1e3, ts[v][steps / 2] * 1e3); }
    printf("B/A median %.3f\n", ts[1][steps / 2] / ts[0][steps / 2]);
}
