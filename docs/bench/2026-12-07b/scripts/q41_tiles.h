/* Shared by the harnesses here: Q4_1-like tiles (int4 values, float16 scales and mins, groups
 * of 32) of an n x k weight, filled with a fixed pattern, and a clock. */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { int64_t n, k; uint8_t *qw; uint16_t *sc, *mn; } mat;
static mat make(int64_t n, int64_t k) {
    mat m = {n, k}; int64_t tiles = (n + 15) / 16, nb = k / 32;
    m.qw = aligned_alloc(64, tiles * nb * 256); m.sc = aligned_alloc(64, tiles * nb * 32 + 64); m.mn = aligned_alloc(64, tiles * nb * 32 + 64);
    for (int64_t i = 0; i < tiles * nb * 256; i++) m.qw[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int64_t i = 0; i < tiles * nb * 16; i++) { m.sc[i] = _cvtss_sh(0.01f + (i % 7) * 0.001f, 0); m.mn[i] = _cvtss_sh(-0.05f, 0); }
    return m;
}
/* bytes a kernel reads of one: the values and the scales and mins */
static double bytes(mat m) { return (double)m.n * m.k / 2 + (double)m.n * m.k / 32 * 4; }
