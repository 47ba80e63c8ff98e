/* batched decode attention harness (tm_paged_attention): B requests of about n keys each (seq lens n - (37 b mod 64)), blocks 7 apart, L layers' caches in turn; args: Hq Hkv D n L threads B bf16(0/1) [rounds] */
#include <stdio.h>
#include KERNELS
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int64_t Hq = atoi(argv[1]), Hkv = atoi(argv[2]), D = atoi(argv[3]), n = atoi(argv[4]);
    int L = atoi(argv[5]), nt = atoi(argv[6]), B = atoi(argv[7]), dt = atoi(argv[8]) ? KV_BF16 : KV_F16; const int64_t bs = 16;
    int64_t per = n / bs + 1, nblk = per * B, slots = nblk * bs;
    uint16_t **kc = malloc(L * sizeof(void*)), **vc = malloc(L * sizeof(void*));
    for (int l = 0; l < L; l++) {
        kc[l] = aligned_alloc(64, slots * Hkv * D * 2 + 64); vc[l] = aligned_alloc(64, slots * Hkv * D * 2 + 64);
        for (int64_t i = 0; i < slots * Hkv * D; i++) { kc[l][i] = _cvtss_sh((float)((i * 7919) % 1000) / 1000.f - 0.5f, 0) & (dt == KV_BF16 ? 0x7fff : 0xffff); vc[l][i] = _cvtss_sh((float)((i * 104729) % 1000) / 1000.f - 0.5f, 0) & (dt == KV_BF16 ? 0x3fff : 0xffff); }
    }
    int64_t *table = malloc(nblk * 8); for (int64_t b = 0; b < nblk; b++) table[b] = (b * 7) % nblk;
    float *q = malloc(B * Hq * D * 4), *o = malloc(B * Hq * D * 4);
    for (int64_t i = 0; i < B * Hq * D; i++) q[i] = (float)(i % 13) / 13.f - 0.5f;
    int64_t *qs = malloc(B * 8), *ql = malloc(B * 8), *sl = malloc(B * 8);
    for (int b = 0; b < B; b++) { qs[b] = b; ql[b] = 1; sl[b] = n - (b * 37) % 64; }
    double best = 1e9, keys = 0; for (int b = 0; b < B; b++) keys += sl[b];
    int R = argc > 9 ? atoi(argv[9]) : 15; for (int r = 0; r < R; r++) {
        double t = now();
        for (int l = 0; l < L; l++)
            tm_paged_attention(q, Hq * D, Hq, D, kc[l], vc[l], NULL, NULL, dt, bs, Hkv, table, per, B, qs, ql, sl, NULL, 0.125f, 0, o, nt);
        t = (now() - t) / L; if (t < best) best = t;
    }
    double s = 0; for (int64_t i = 0; i < B * Hq * D; i++) s += o[i];
    printf("B %d n %ld L %d t%d: %.1f us/layer, %.2f ns/key, %.1f GB/s (check %.6g)\n", B, n, L, nt, best * 1e6, best / keys * 1e9, 2.0 * Hkv * D * 2 * keys / best / 1e9, s);
}
