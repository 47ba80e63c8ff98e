/* A barrier over flags in shared memory, for the tensor-parallel ranks of one host
 * (tokenmill/distributed/shm_comm.py). Rank r publishes "I reached step seq" in its own
 * cache line, then waits until every rank has. The full fence first makes the rank's
 * payload writes (plain or non-temporal stores) visible before its flag; the acquire loads
 * order the payload reads after the flags. Waiting spins briefly, then yields the core, so
 * more ranks than cores still make progress. */
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <immintrin.h>

#define TM_FLAG_STRIDE 8   /* int64s per flag: one 64-byte cache line each */

static double tm_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 0 once every rank reached seq; 1 if one did not within timeout_s (a dead peer). */
int tm_shm_barrier(int64_t *flags, int32_t rank, int32_t world, int64_t seq, double timeout_s) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&flags[(int64_t)rank * TM_FLAG_STRIDE], seq, __ATOMIC_RELEASE);
    double deadline = 0.0;
    for (int32_t r = 0; r < world; r++) {
        int64_t *flag = &flags[(int64_t)r * TM_FLAG_STRIDE];
        for (int64_t spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; spins++) {
            if (spins < 20000) {
                _mm_pause();
                continue;
            }
            if (deadline == 0.0)
                deadline = tm_now_s() + timeout_s;
            else if (tm_now_s() > deadline)
                return 1;
            sched_yield();
        }
    }
    return 0;
}
