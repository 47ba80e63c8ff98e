/* B=1 fp32 decode GEMVs (SmolLM2 shapes) over 30 layers of weights, the weights on 4 KB pages vs 2 MB pages, interleaved in one process; args: M ROUNDS */
#include <stdio.h>
#include <sys/mman.h>
#include KERNELS
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
  int L = 30, M = atoi(argv[1]), nt = 2, R = atoi(argv[2]);
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  int64_t per = 0; for (int i = 0; i < 4; i++) per += shapes[i][0] * shapes[i][1];
  size_t bytes = (size_t)per * L * 4 + (2 << 20);
  float *arena[2];
  for (int h = 0; h < 2; h++) {
    char *p = mmap(0, bytes + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    p = (char *)(((uintptr_t)p + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
    madvise(p, bytes, h ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    arena[h] = (float *)p;
    for (size_t j = 0; j < (size_t)per * L; j++) arena[h][j] = (float)((j * 7919) % 1000) / 20000.f - 0.025f;
  }
  float *x = malloc(M * 1536 * 4), *y = malloc(M * 3072 * 4);
  for (int64_t j = 0; j < M * 1536; j++) x[j] = (float)((j * 104729) % 1000) / 1000.f - 0.5f;
  double best[2] = {1e9, 1e9}, sum[2] = {0, 0};
  for (int r = 0; r < R; r++) for (int h = 0; h < 2; h++) {
    double t = now(); float *w = arena[h];
    for (int l = 0; l < L; l++) for (int i = 0; i < 4; i++) {
      tm_linear_blocked(x, M, shapes[i][1], w, shapes[i][0], NULL, y, nt); w += shapes[i][0] * shapes[i][1]; }
    t = now() - t; sum[h] += t; if (t < best[h]) best[h] = t;
  }
  for (int h = 0; h < 2; h++) printf("M %d huge %d: best %.2f ms (%.1f GB/s), mean %.2f ms\n", M, h, best[h] * 1e3, per * L * 4.0 / best[h] / 1e9, sum[h] / R * 1e3);
  FILE*f=fopen("/proc/self/smaps_rollup","r"); char l[256]; while(fgets(l,256,f)) if(strstr(l,"AnonHuge")) fputs(l,stdout);
}
