/* prefill attention harness: one request, chunk of R query rows ending at position n-1, fp16 cache, nthreads */
#include <stdio.h>
#include KERNELS
#include <time.h>
int main(int argc, char **argv) {
    int64_t Hq = atoi(argv[1]), Hkv = atoi(argv[2]), D = atoi(argv[3]), n = atoi(argv[4]), R = atoi(argv[5]);
    int nt = atoi(argv[6]), reps = atoi(argv[7]); int64_t window = argc > 8 ? atoi(argv[8]) : 0; const int64_t bs = 16;
    int64_t nblk = n / bs + 1, slots = nblk * bs;
    uint16_t *kc = aligned_alloc(64, slots * Hkv * D * 2 + 64), *vc = aligned_alloc(64, slots * Hkv * D * 2 + 64);
    for (int64_t i = 0; i < slots * Hkv * D; i++) { kc[i] = _cvtss_sh((float)((i * 7919) % 1000) / 1000.f - 0.5f, 0); vc[i] = _cvtss_sh((float)((i * 104729) % 1000) / 1000.f - 0.5f, 0); }
    int64_t *table = malloc(nblk * 8); for (int64_t b = 0; b < nblk; b++) table[b] = (b * 7) % nblk;
    float *q = malloc(R * Hq * D * 4), *o = malloc(R * Hq * D * 4);
    for (int64_t i = 0; i < R * Hq * D; i++) q[i] = (float)(i % 13) / 13.f - 0.5f;
    int64_t qs = 0, ql = R, sl = n;
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        double t = omp_get_wtime();
        tm_prefill_attention(q, Hq * D, Hq, D, kc, vc, NULL, NULL, KV_F16, bs, Hkv, table, nblk, 1, &qs, &ql, &sl, 1.0f / 8, window, o, nt);
        t = omp_get_wtime() - t; if (t < best) best = t;
    }
    double s = 0; for (int64_t i = 0; i < R * Hq * D; i++) s += o[i] * (1 + i % 7);
    double keys = 0; for (int64_t i = 0; i < R; i++) { int64_t p = n - R + i; keys += window > 0 && p + 1 > window ? window : p + 1; }
    printf("Hq %ld Hkv %ld D %ld n %ld rows %ld t%d: %.2f ms, %.1f GMAC/s (check %.9g)\n", Hq, Hkv, D, n, R, nt, best * 1e3, keys * Hq * D * 2 / best / 1e9, s);
}
