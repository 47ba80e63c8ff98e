/* B=1 decode attention over L layers, fp16 KV, 4 KB vs huge pages interleaved; args: n L rounds scatter */
#include <stdio.h>
#include <sys/mman.h>
#include KERNELS
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
  int64_t Hq = 9, Hkv = 3, D = 64, n = atoi(argv[1]); int L = atoi(argv[2]), R = atoi(argv[3]), scatter = atoi(argv[4]), nt = 2; const int64_t bs = 16;
  int64_t nblk = n / bs + 1, slots = nblk * bs, tb = slots * Hkv * D * 2;
  uint16_t *kc[2][64], *vc[2][64];
  for (int h = 0; h < 2; h++) {
    size_t bytes = 2 * L * tb + (4 << 20);
    char *p = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(p, bytes, h ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    p = (char *)(((uintptr_t)p + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
    for (int l = 0; l < L; l++) { kc[h][l] = (uint16_t *)(p + 2 * l * tb); vc[h][l] = (uint16_t *)(p + (2 * l + 1) * tb);
      for (int64_t i = 0; i < slots * Hkv * D; i++) { kc[h][l][i] = _cvtss_sh((float)((i * 7919) % 1000) / 1000.f - 0.5f, 0); vc[h][l][i] = _cvtss_sh((float)((i * 104729) % 1000) / 1000.f - 0.5f, 0); } }
  }
  int64_t *table = malloc(nblk * 8); for (int64_t b = 0; b < nblk; b++) table[b] = scatter ? (b * 7) % nblk : b;
  float *q = malloc(Hq * D * 4), *o = malloc(Hq * D * 4);
  for (int64_t i = 0; i < Hq * D; i++) q[i] = (float)(i % 13) / 13.f - 0.5f;
  int64_t qs = 0, ql = 1, sl = n; double best[2] = {1e9, 1e9}, sum[2] = {0, 0};
  for (int r = 0; r < R; r++) for (int h = 0; h < 2; h++) {
    double t = now();
    for (int l = 0; l < L; l++)
      tm_paged_attention(q, Hq * D, Hq, D, kc[h][l], vc[h][l], NULL, NULL, KV_F16, bs, Hkv, table, nblk, 1, &qs, &ql, &sl, NULL, 0.125f, 0, o, nt);
    t = (now() - t) / L; sum[h] += t; if (t < best[h]) best[h] = t;
  }
  for (int h = 0; h < 2; h++) printf("n %ld scatter %d huge %d: best %.1f us/layer %.1f GB/s, mean %.1f us\n", n, scatter, h, best[h] * 1e6, 2.0 * Hkv * D * 2 * n / best[h] / 1e9, sum[h] / R * 1e6);
  FILE*f=fopen("/proc/self/smaps_rollup","r"); char l[256]; while(fgets(l,256,f)) if(strstr(l,"AnonHuge")) fputs(l,stdout);
}
