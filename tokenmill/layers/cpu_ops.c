/* Fused float32 CPU kernels for the per-layer small ops of a decode step (AVX2 + FMA).
 *
 * In eager PyTorch a decode step of a 30-layer model issues ~60 tiny ops per layer, each
 * costing microseconds of dispatch: more than the attention math itself. These kernels do
 * one layer-op in one call:
 *   tm_rms_norm        optional residual add (in place) + RMSNorm (Llama or Gemma weights)
 *   tm_rope            neox-style rotary embedding of q and k, in place
 *   tm_silu_mul        silu(gate) * up of a fused [T, 2I] gate_up output
 *   tm_gelu_tanh_mul   gelu_tanh(gate) * up, likewise (Gemma)
 *   tm_linear_small_m  x W^T for decode-sized x: one to eight rows stream W once, more
 *                      take the blocked kernel of cpu_gemm.c (same bits per row)
 *   tm_linear_half     the same for 16-bit (fp16 / bf16) weights, widened in registers
 *   tm_argmax_rows     the greedy token of each logits row (torch.argmax's answer)
 *   tm_nonfinite_rows  which rows hold a NaN or an infinity (the step's hidden states, logits)
 * Plain-PyTorch references live beside the callers (tokenmill/layers/cpu_ops.py) and the
 * tests compare the two.
 */
#include "cpu_simd.h"

/* ---- RMSNorm ------------------------------------------------------------------------- */
/* If residual != NULL: residual[t] += x[t] (the new residual stream, in place) and the norm
 * reads it; else the norm reads x. out[t] = v / sqrt(mean(v^2) + eps) * w, or with `gemma`
 * (GemmaRMSNorm stores w - 1) * (1 + w), the sum rounded to float first as torch's
 * ``1.0 + weight.float()`` is. out may be x itself (each element is read before it is
 * written): the fused decode stack normalises q / k heads in place. */
void tm_rms_norm(const float *x, float *residual, const float *w, float eps, int gemma,
                 int64_t T, int64_t H, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const float *xi = x + t * H;
        float *v = residual ? residual + t * H : (float *)xi;
        float *o = out + t * H;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            __m256 a = _mm256_loadu_ps(xi + i);
            if (residual) { a = _mm256_add_ps(a, _mm256_loadu_ps(v + i)); _mm256_storeu_ps(v + i, a); }
            acc = _mm256_fmadd_ps(a, a, acc);
        }
        float ss = hsum256(acc);
        for (; i < H; i++) {
            float a = xi[i];
            if (residual) { a += v[i]; v[i] = a; }
            ss += a * a;
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        const __m256 vinv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
        /* Llama: w * (v * inv); Gemma: (v * inv) * (1 + w), each in its HF reference's order */
        for (i = 0; i + 8 <= H; i += 8) {
            __m256 n = _mm256_mul_ps(_mm256_loadu_ps(v + i), vinv);
            __m256 wv = _mm256_loadu_ps(w + i);
            _mm256_storeu_ps(o + i, gemma ? _mm256_mul_ps(n, _mm256_add_ps(one, wv)) : _mm256_mul_ps(wv, n));
        }
        for (; i < H; i++) o[i] = gemma ? (v[i] * inv) * (1.0f + w[i]) : w[i] * (v[i] * inv);
    }
}

/* ---- rotary -------------------------------------------------------------------------- */
/* Neox layout: x[i], x[i + D/2] rotate together. x rows have `row_stride` floats between
 * tokens and D floats between heads; cos/sin tables are [P, D] indexed by positions. */
static void rope_rows(float *x, int64_t T, int64_t heads, int64_t D, int64_t row_stride,
                      const float *cos, const float *sin, const int64_t *pos) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * D;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
                __m256 ra = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
                __m256 rb = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(v + i, ra);
                _mm256_storeu_ps(v + half + i, rb);
            }
            for (; i < half; i++) {
                float a = v[i], b = v[half + i];
                v[i] = a * c[i] - b * s[i];
                v[half + i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

void tm_rope(float *q, float *k, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
             int64_t q_stride, int64_t k_stride, const float *cos, const float *sin,
             const int64_t *pos) {
    rope_rows(q, T, Hq, D, q_stride, cos, sin, pos);
    rope_rows(k, T, Hkv, D, k_stride, cos, sin, pos);
}

/* ---- silu(gate) * up ----------------------------------------------------------------- */
void tm_silu_mul(const float *x, int64_t T, int64_t I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 a = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, a))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(a, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* ---- gelu_tanh(gate) * up ------------------------------------------------------------
 * torch's gelu(approximate="tanh") is 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
 * 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), so this computes x / (1 + exp(-2u)): the same
 * function without a tanh, and without the cancellation in 1 + tanh(u) that costs torch
 * digits below x ~ -1 (1e-5 relative at x = -2, all of them below -5). Against float64:
 * this ~2e-7 relative from -5 up, torch 1e-7 above -1; the two differ by under 2e-7
 * relative or 2e-7 absolute (tests/layers/test_cpu_ops.py). */
static inline __m256 gelu_tanh256(__m256 x) {
    const __m256 k2beta = _mm256_set1_ps(-2.0f * 0.7978845608028654f), kappa = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(kappa, x), _mm256_mul_ps(x, x), x);   /* x + k x^3 */
    return _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_mul_ps(k2beta, inner))));
}

void tm_gelu_tanh_mul(const float *x, int64_t T, int64_t I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu_tanh256(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        if (i < I) {   /* the tail through the same vector code: one set of bits per value */
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, g + i, sizeof(float) * (size_t)(I - i));
            memcpy(ut, u + i, sizeof(float) * (size_t)(I - i));
            _mm256_storeu_ps(ot, _mm256_mul_ps(gelu_tanh256(_mm256_loadu_ps(gt)), _mm256_loadu_ps(ut)));
            memcpy(o + i, ot, sizeof(float) * (size_t)(I - i));
        }
    }
}

/* ---- small-M float32 matmul: y[M, N] = x[M, K] W[N, K]^T (+ bias) ---------------------
 * Decode multiplies one (or a few) activation rows by every weight: pure weight streaming,
 * so the goal is reading W once at memory bandwidth. Each thread walks its contiguous share
 * of W one row at a time (a single linear stream the hardware prefetchers follow) and runs
 * all M activation rows (kept in L1) against it: one FMA chain per output, so an output's
 * bits do not depend on M (a verify step of k + 1 rows gives what k + 1 decode steps
 * would). Up to GEMV_MAX_M rows share one pass over W; more take cpu_gemm.c's blocked
 * kernel, which keeps these chains. */
#define GEMV_MAX_M 8
/* Prefetch distance in bytes: the hardware prefetchers alone left the stream at 19-24
 * GB/s at one row and 15-17 at four on an Emerald Rapids Xeon, 2 threads; 4 KB ahead read
 * 24-28 and 23-26 (a few rows of a 576-column weight; past the end it is a no-op). Into
 * L2 (T1): on Zen 4, T0's L1 fills read 22-29 GB/s at four rows where T1 read 30-35. */
#define GEMV_PREFETCH_BYTES 4096
/* 16-bit weights: 8 KB ahead (the LM head at one row: 16-18 GB/s at 4 KB, 19 at 8 KB; 2 KB
 * read 16-18, 16 KB 18-22, same box, noisy) */
#define GEMV_PREFETCH_HALF 8192

/* Weight row n against M (compile-time 1..GEMV_MAX_M at each call) activation rows. W has
 * value type dt (KV_F32, or KV_F16 / KV_BF16: 16-bit weights widened exactly to float32 in
 * registers), so a 16-bit weight gives the bits of float32 math on its widened values. */
static inline __attribute__((always_inline)) void
gemv_row_chain(const float *x, const int M, int64_t K, const void *w, const int dt,
               const float *bias, float *y, int64_t N, int64_t n) {
    __m256 acc[GEMV_MAX_M];
    const int64_t esize = kv_elem_bytes(dt);
    const void *wr = (const char *)w + n * K * esize;
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (((k * esize) & 63) == 0)   /* one cache line of the stream, a few KB ahead */
            _mm_prefetch((const char *)wr + k * esize + (esize == 4 ? GEMV_PREFETCH_BYTES : GEMV_PREFETCH_HALF), _MM_HINT_T1);
        __m256 a = kv_load8(wr, k, dt);
        for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; m++) {
        float s = hsum256(acc[m]);
        for (int64_t kk = k; kk < K; kk++) s = fmaf(kv_load1(wr, kk, dt), x[m * K + kk], s);
        y[m * N + n] = s + (bias ? bias[n] : 0.0f);
    }
}

/* Rows [0, M) with M <= GEMV_MAX_M, W (value type dt) streamed once. */
static inline __attribute__((always_inline)) void
gemv_rows_as(const float *x, int64_t M, int64_t K, const void *w, const int dt, int64_t N,
             const float *bias, float *y, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++) {
        switch (M) {   /* constant M per call: the loops over rows unroll */
            case 1: gemv_row_chain(x, 1, K, w, dt, bias, y, N, n); break;
            case 2: gemv_row_chain(x, 2, K, w, dt, bias, y, N, n); break;
            case 3: gemv_row_chain(x, 3, K, w, dt, bias, y, N, n); break;
            case 4: gemv_row_chain(x, 4, K, w, dt, bias, y, N, n); break;
            case 5: gemv_row_chain(x, 5, K, w, dt, bias, y, N, n); break;
            case 6: gemv_row_chain(x, 6, K, w, dt, bias, y, N, n); break;
            case 7: gemv_row_chain(x, 7, K, w, dt, bias, y, N, n); break;
            default: gemv_row_chain(x, 8, K, w, dt, bias, y, N, n); break;
        }
    }
}

/* gemv_rows_as compiled once per weight type (a constant dt: no per-load branch). */
static void gemv_rows(const float *x, int64_t M, int64_t K, const void *w, int dt, int64_t N,
                      const float *bias, float *y, int nthreads) {
    switch (dt) {
    case KV_F16: gemv_rows_as(x, M, K, w, KV_F16, N, bias, y, nthreads); break;
    case KV_BF16: gemv_rows_as(x, M, K, w, KV_BF16, N, bias, y, nthreads); break;
    default: gemv_rows_as(x, M, K, w, KV_F32, N, bias, y, nthreads);
    }
}

/* The same rows GEMV_MAX_M at a time (one pass over W each). */
static void gemv_row_slices(const float *x, int64_t M, int64_t K, const void *w, int dt,
                            int64_t N, const float *bias, float *y, int nthreads) {
    for (int64_t m0 = 0; m0 < M; m0 += GEMV_MAX_M)
        gemv_rows(x + m0 * K, M - m0 < GEMV_MAX_M ? M - m0 : GEMV_MAX_M, K, w, dt, N, bias,
                  y + m0 * N, nthreads);
}

static void linear_blocked_as(const float *x, int64_t M, int64_t K, const void *w, int dt,
                              int64_t N, const float *bias, float *y, int nthreads);   /* cpu_gemm.c */

/* Any M: up to GEMV_MAX_M rows stream W once; more are compute-bound and take the
 * register-blocked kernel (cpu_gemm.c), whose outputs have these same bits. */
void tm_linear_small_m(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y, int nthreads) {
    if (M > GEMV_MAX_M) linear_blocked_as(x, M, K, w, KV_F32, N, bias, y, nthreads);
    else gemv_rows(x, M, K, w, KV_F32, N, bias, y, nthreads);
}

/* x W^T (+ bias) for W of 16-bit values (wdt: KV_F16 / KV_BF16), float32 activations and
 * sums, any M: the bits of tm_linear_small_m on W widened to float32, reading half the
 * bytes. */
void tm_linear_half(const float *x, int64_t M, int64_t K, const void *w, int wdt, int64_t N,
                    const float *bias, float *y, int nthreads) {
    if (M > GEMV_MAX_M) linear_blocked_as(x, M, K, w, wdt, N, bias, y, nthreads);
    else gemv_rows(x, M, K, w, wdt, N, bias, y, nthreads);
}

/* ---- argmax ------------------------------------------------------------------------------ */
/* out[r] = the index of row r's largest value, the first one on ties, or of its first NaN
 * if it has one (torch.argmax's answer). torch's CPU argmax reads a 262k-token row at about
 * 2 GB/s; two vector passes over the row (the maximum, then where it first occurs) read it
 * from cache, where the head has just written it. */
static int64_t argmax_row(const float *x, int64_t V) {
    __m256 m8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m8 = _mm256_max_ps(m8, v);
    }
    float m = hmax256(m8);
    int nan = _mm256_movemask_ps(nan8) != 0;
    for (; i < V; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > m) m = x[i];
    }
    /* the first lane equal to m (or unordered: a NaN), eight at a time */
    const __m256 target = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                               : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    for (; j < V; j++)
        if (nan ? x[j] != x[j] : x[j] == m) return j;
    return 0;   /* V == 0 */
}

void tm_argmax_rows(const float *x, int64_t R, int64_t V, int64_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (R > 1)
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * V, V);
}

/* ---- non-finite rows -------------------------------------------------------------------- */
/* Does x[0 .. n) hold a NaN or an infinity? v - v is +0 for a finite v and NaN otherwise;
 * OR-ing those bit patterns leaves a lane NaN once any of its values was not finite. */
static int span_nonfinite(const float *x, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_or_ps(acc0, _mm256_sub_ps(a, a));
        acc1 = _mm256_or_ps(acc1, _mm256_sub_ps(b, b));
    }
    const __m256 acc = _mm256_or_ps(acc0, acc1);
    int bad = _mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) != 0;
    for (; i < n; i++) bad |= x[i] - x[i] != 0.0f;   /* NaN != 0 */
    return bad;
}

/* flags[r] = 1 where row r of x [R, D] holds a NaN or an infinity, else 0; returns how many
 * rows do. flags == NULL: only whether any value is not finite (1 or 0), the usual step's
 * whole question. A decode step checks its hidden states and its logits with this: one pass
 * over rows the head has just written, where two tensor ops and a read-back cost several
 * times more. Large inputs (prefill chunks, a wide batch's logits) are split in spans over
 * the threads, each span inside one row. */
int64_t tm_nonfinite_rows(const float *x, int64_t R, int64_t D, uint8_t *flags, int nthreads) {
    const int64_t span = 16384;   /* values per task */
    const int64_t per_row = D > 0 ? (D + span - 1) / span : 0;
    int any = 0;
    if (flags)
        for (int64_t r = 0; r < R; r++) flags[r] = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (R * D >= 4 * span)
    for (int64_t task = 0; task < R * per_row; task++) {
        const int64_t r = task / per_row, start = (task % per_row) * span;
        const int64_t n = D - start < span ? D - start : span;
        if (span_nonfinite(x + r * D + start, n)) {
            if (flags) {
                #pragma omp atomic write
                flags[r] = 1;
            } else {
                #pragma omp atomic write
                any = 1;
            }
        }
    }
    if (!flags) return any;
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++) bad += flags[r];
    return bad;
}
