/* fp32 decode at 32 sequences, per layer: 4 GEMMs + paged attention (fp32 K/V, ~200 keys a sequence), 30 layers; side 1: the next layers K/V prefetched during the MLP GEMMs (a HARNESS-only hook patched into a copy of cpu_gemm.c: side_p / side_lines / side_steps / side_due thread-locals, one prefetch per due line in gemm_block512s k loop); mode 3: the layers K/V prefetched just before its attention. args: ROUNDS KEYS MODE */
#include <stdio.h>
#define SIDE_HINT _MM_HINT_T1
#include KERNELS
#include <omp.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void side_set(const char *k, const char *v, int64_t bytes, double f0, double f1, int64_t steps_per_thread, int nt) {
  /* lines [f0, f1) of K then V (2*bytes), split in nt thread halves */
  #pragma omp parallel num_threads(nt)
  { int t = omp_get_thread_num(); int64_t tot = 2 * bytes / 64, a = (int64_t)(f0 * tot), b = (int64_t)(f1 * tot);
    int64_t lo = a + (b - a) * t / nt, hi = a + (b - a) * (t + 1) / nt;
    /* hack: a range that straddles K/V only prefetches from K's base onward: make halves per buffer */
    if (!k) { side_lines = 0; side_p = 0; }
    else { const char *base = lo < bytes / 64 ? k + lo * 64 : v + (lo - bytes / 64) * 64;
      side_p = base; side_lines = hi - lo; side_steps = steps_per_thread; side_due = 0; } }
}
int main(int argc, char **argv) {
  int L = 30, M = 32, nt = 2, R = atoi(argv[1]); int64_t n = atoi(argv[2]); const int64_t bs = 16, Hq = 9, Hkv = 3, D = 64;
  int mode = atoi(argv[3]);
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  float **w = malloc(L * 4 * sizeof(float*));
  for (int i = 0; i < L * 4; i++) { int64_t nn = shapes[i % 4][0] * shapes[i % 4][1]; w[i] = aligned_alloc(64, nn * 4);
    for (int64_t j = 0; j < nn; j++) w[i][j] = (float)(((j + i) * 7919) % 1000) / 20000.f - 0.025f; }
  int64_t per = n / bs + 1, nblk = per * M, slots = nblk * bs, kvbytes = slots * Hkv * D * 4;
  float **kc = malloc(L * sizeof(void*)), **vc = malloc(L * sizeof(void*));
  for (int l = 0; l < L; l++) { kc[l] = aligned_alloc(64, kvbytes); vc[l] = aligned_alloc(64, kvbytes);
    for (int64_t i = 0; i < slots * Hkv * D; i++) { kc[l][i] = (float)((i * 7919) % 1000) / 1000.f - 0.5f; vc[l][i] = (float)((i * 104729) % 1000) / 1000.f - 0.5f; } }
  int64_t *table = malloc(nblk * 8); for (int64_t b = 0; b < nblk; b++) table[b] = (b * 7) % nblk;
  int64_t *qs = malloc(M * 8), *ql = malloc(M * 8), *sl = malloc(M * 8); double keys = 0;
  for (int b = 0; b < M; b++) { qs[b] = b; ql[b] = 1; sl[b] = n - (b * 37) % 64; keys += sl[b]; }
  float *x = malloc(M * 1536 * 4), *y = malloc(M * 3072 * 4), *q = malloc(M * 960 * 4), *att = malloc(M * 576 * 4);
  for (int64_t j = 0; j < M * 1536; j++) x[j] = (float)((j * 104729) % 1000) / 1000.f - 0.5f;
  for (int64_t j = 0; j < M * 960; j++) q[j] = (float)(j % 13) / 13.f - 0.5f;
  const int64_t pb = 6; /* row blocks at 32 rows */
  for (int r = 0; r < R; r++) {
    for (int side = 0; side < 2; side++) {
      double tg = 0, ta = 0, t0 = now();
      for (int l = 0; l < L; l++) {
        double a = now();
        tm_linear_blocked(x, M, 576, w[l*4], 960, NULL, y, nt);
        if (side && mode == 3) {
          #pragma omp parallel for num_threads(nt)
          for (int64_t i = 0; i < kvbytes / 4; i += 16) { _mm_prefetch((char*)(kc[l] + i), _MM_HINT_T1); _mm_prefetch((char*)(vc[l] + i), _MM_HINT_T1); }
        }
        double b = now(); ta -= b;
        tm_paged_attention(q, 960, Hq, D, kc[l], vc[l], NULL, NULL, KV_F32, bs, Hkv, table, per, M, qs, ql, sl, NULL, 0.125f, 0, att, nt);
        double c = now(); ta += c;
        tm_linear_blocked(att, M, 576, w[l*4+1], 576, NULL, y, nt);
        int ln = (l + 1) % L;
        if (side && mode >= 1) side_set((char*)kc[ln], (char*)vc[ln], kvbytes, 0, mode == 2 ? 1.0 : 0.5, (3072/8/nt) * pb * (576/8), nt);
        tm_linear_blocked(x, M, 576, w[l*4+2], 3072, NULL, y, nt);
        if (side && mode >= 1) side_set(mode == 2 ? 0 : (char*)kc[ln], (char*)vc[ln], kvbytes, 0.5, 1.0, (576/8/nt) * pb * (1536/8), nt);
        tm_linear_blocked(y, M, 1536, w[l*4+3], 576, NULL, x, nt);
        side_set(0, 0, 0, 0, 0, 1, nt);
        for (int64_t j = 0; j < M * 576; j++) x[j] = x[j] * 0.01f + 0.1f;
        tg += (now() - a) - (c - b);
      }
      double t = now() - t0;
      printf("side %d: step %.2f ms, gemm %.2f ms, attention %.2f ms (%.1f GB/s)\n", side, t * 1e3, tg * 1e3, ta * 1e3, 2.0 * Hkv * D * 4 * keys * L / ta / 1e9);
    }
  }
}
