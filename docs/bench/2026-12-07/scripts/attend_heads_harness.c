#include <stdio.h>
/* single-thread harness: attend_heads over n keys (warm), SRC = the cpu_attention.c variant dir */
#include KERNELS
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int64_t Hq = atoi(argv[1]), Hkv = atoi(argv[2]), D = atoi(argv[3]), n = atoi(argv[4]);
    int reps = atoi(argv[5]); const int64_t bs = 16;
    int64_t nblk = n / bs + 1, slots = nblk * bs;
    uint16_t *kc = aligned_alloc(64, slots * Hkv * D * 2 + 64), *vc = aligned_alloc(64, slots * Hkv * D * 2 + 64);
    for (int64_t i = 0; i < slots * Hkv * D; i++) { kc[i] = _cvtss_sh((float)((i * 7919) % 1000) / 1000.f - 0.5f, 0); vc[i] = _cvtss_sh((float)((i * 104729) % 1000) / 1000.f - 0.5f, 0); }
    int64_t *table = malloc(nblk * 8); for (int64_t b = 0; b < nblk; b++) table[b] = (b * 7) % nblk;
    float *q = malloc(Hq * D * 4), *o = malloc(Hq * D * 4), *scores = malloc((Hq * n + 2 * Hq + 8) * 4);
    for (int64_t i = 0; i < Hq * D; i++) q[i] = (float)(i % 13) / 13.f - 0.5f;
    double best = 1e9;
    for (int r = 0; r < 7; r++) {
        double t = now();
        for (int i = 0; i < reps; i++)
            attend_heads(q, Hq, Hkv, D, kc, vc, NULL, NULL, KV_F16, table, bs, NO_SWAP, 0, n, 0.125f, o, scores, scores + Hq * n, 1);
        t = (now() - t) / reps; if (t < best) best = t;
    }
    double s = 0; for (int64_t i = 0; i < Hq * D; i++) s += o[i];
    printf("Hq %ld Hkv %ld D %ld n %ld: %.1f us, %.2f ns/key, %.1f GMAC/s (check %.6g)\n", Hq, Hkv, D, n, best * 1e6, best / n * 1e9, 2.0 * Hq * D * n / best / 1e9, s);
}
