/* SmolLM2-shaped Q4_1 (half scales + mins) decode GEMVs: the 120 calls of one step in turn,
 * each on its own cold tiles, against one call over as many bytes. argv: nthreads reps */
#include <stdio.h>
#include KERNELS
#include <time.h>
#include "q41_tiles.h"
int main(int argc, char **argv) {
    int nt = atoi(argv[1]), reps = atoi(argv[2]);
    const int L = 30; int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    mat ms[L * 4]; double total = 0;
    for (int l = 0; l < L; l++) for (int j = 0; j < 4; j++) { ms[l * 4 + j] = make(shapes[j][0], shapes[j][1]); total += bytes(ms[l * 4 + j]); }
    mat big = make(30 * (960 + 576 + 3072) + 30 * 576 * 1536 / 576, 576);
    float *x = malloc(1536 * 4), *y = malloc(200000 * 4);
    for (int i = 0; i < 1536; i++) x[i] = (float)((i * 37) % 101) / 101.f - 0.5f;
    double best_seq = 1e9, best_big = 1e9;
    for (int r = 0; r < reps; r++) {
        double t = now();
        for (int i = 0; i < L * 4; i++) tm_qgemm_q8(x, 1, ms[i].k, 1 | 8, ms[i].qw, (const float *)ms[i].sc, (const float *)ms[i].mn, 32, ms[i].n, y, nt);
        t = now() - t; if (t < best_seq) best_seq = t;
        t = now();
        tm_qgemm_q8(x, 1, 576, 1 | 8, big.qw, (const float *)big.sc, (const float *)big.mn, 32, big.n, y, nt);
        t = now() - t; if (t < best_big) best_big = t;
    }
    printf("t%d: 120 calls %.3f ms (%.1f GB/s, %.1f MB); one call %.3f ms (%.1f GB/s, %.1f MB)\n", nt,
           best_seq * 1e3, total / best_seq / 1e9, total / 1e6, best_big * 1e3, bytes(big) / best_big / 1e9, bytes(big) / 1e6);
}
