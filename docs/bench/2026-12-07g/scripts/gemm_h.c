/* fp32 blocked GEMM harness: SmolLM2's 4 shapes x L layers, M rows, nt threads */
#include <stdio.h>
#include KERNELS
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int L = atoi(argv[1]), M = atoi(argv[2]), nt = atoi(argv[3]), R = argc > 4 ? atoi(argv[4]) : 10, only = argc > 5 ? atoi(argv[5]) : -1;
    const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    float **w = malloc(L * 4 * sizeof(float*));
    double flop = 0, bytes = 0;
    for (int i = 0; i < L * 4; i++) {
        int64_t n = shapes[i % 4][0] * shapes[i % 4][1];
        w[i] = aligned_alloc(64, n * 4);
        for (int64_t j = 0; j < n; j++) w[i][j] = (float)(((j + i) * 7919) % 1000) / 20000.f - 0.025f;
        if (only >= 0 && i % 4 != only) continue; flop += 2.0 * n * M; bytes += n * 4.0;
    }
    float *x = malloc(M * 1536 * 4), *y = malloc(M * 3072 * 4);
    for (int64_t j = 0; j < M * 1536; j++) x[j] = (float)((j * 104729) % 1000) / 1000.f - 0.5f;
    double best = 1e9, chk = 0;
    for (int r = 0; r < R; r++) {
        double t = now();
        for (int i = 0; i < L * 4; i++) if (only < 0 || i % 4 == only) tm_linear_blocked(x, M, shapes[i % 4][1], w[i], shapes[i % 4][0], NULL, y, nt);
        t = now() - t; if (t < best) best = t;
    }
    for (int64_t j = 0; j < M * 576; j++) chk += y[j];
    printf("L%d M%d t%d: %.3f ms, %.0f GFLOP/s, %.1f GB/s W (check %.9g)\n", L, M, nt, best * 1e3, flop / best / 1e9, bytes / best / 1e9, chk);
}
