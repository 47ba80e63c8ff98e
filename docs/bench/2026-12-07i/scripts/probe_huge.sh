#!/bin/bash
# the bench probe (measure_read_bandwidth_gbps) as committed (huge pages) and a torch sum over
# 4 KB pages vs 2 MB pages (torch's THP_MEM_ALLOC_ENABLE), then read_huge.c; 3 runs each
HERE=$(dirname "$(readlink -f "$0")"); . /work/venv/bin/activate
gcc -O3 -mavx512f -fopenmp $HERE/read_huge.c -o /tmp/read_huge
for i in 1 2 3; do
  python -c "import torch; torch.set_num_threads(2); from tokenmill.bench.common import measure_read_bandwidth_gbps as m; print('probe (huge pages):', round(m(), 1), 'GB/s')"
  for t in 0 1; do THP_MEM_ALLOC_ENABLE=$t python -c "
import torch, time; torch.set_num_threads(2); src = torch.ones(64 << 20)
def once():
    t = time.perf_counter(); src.sum(); return (256 << 20) / (time.perf_counter() - t) / 1e9
print('torch sum, THP_MEM_ALLOC_ENABLE=$t:', round(max(once() for _ in range(9)), 1), 'GB/s')"; done
  /tmp/read_huge 0; /tmp/read_huge 1
done
