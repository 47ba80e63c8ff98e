#!/bin/bash
# Interleaved A/B of the fp32 blocked GEMM's prefetch: BASE = the commit before 0a88ce2, NEW =
# 0a88ce2. The kernel alone (gemm_h.c: SmolLM2's four matmul shapes, 32 rows, 30 layers' weights
# cycled so W comes from memory, 1 and 2 threads), then the engine (decode32.py: fp32 decode
# steps at 32 sequences, each run a fresh process).
# usage: ab_gemm_spread.sh REPO   (from this directory, the machine otherwise idle)
REPO=$(readlink -f $1); H=$(pwd); T=$(mktemp -d)
F="-O3 -mavx2 -mfma -mf16c -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512vnni"
git -C $REPO worktree add -f $T/BASE 0a88ce2~1 > /dev/null 2>&1
git -C $REPO worktree add -f $T/NEW 0a88ce2 > /dev/null 2>&1
for v in BASE NEW; do
  gcc $F -DKERNELS="\"$T/$v/tokenmill/layers/cpu_kernels.c\"" $H/gemm_h.c -o $T/h_$v -lm
done
for i in 1 2 3; do for v in BASE NEW; do
  echo -n "$v kernel 1 thread: "; $T/h_$v 30 32 1 5; echo -n "$v kernel 2 threads: "; $T/h_$v 30 32 2 5
done; done
for i in 1 2 3; do for v in BASE NEW; do
  echo -n "$v engine: "; (cd $T && PYTHONPATH=$T/$v python $REPO/docs/bench/2026-12-07e/scripts/decode32.py float32 native 2>&1 | grep ms/step | tail -3 | tr '\n' ' '); echo
done; done
git -C $REPO worktree remove -f $T/BASE; git -C $REPO worktree remove -f $T/NEW
