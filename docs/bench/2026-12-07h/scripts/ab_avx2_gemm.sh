#!/bin/bash
# Interleaved A/B of the AVX2 build's blocked fp32 GEMM prefetch: BASE = the commit before
# 54c294a, NEW = 54c294a. The kernel alone, built as an AVX2-only CPU gets it (2026-12-07g's
# gemm_h.c: SmolLM2's four matmul shapes, 30 layers' weights cycled so W comes from memory;
# 32 and 8 rows; 1 and 2 threads), then the engine under cpu_isa="avx2" (2026-12-07e's
# decode32.py: fp32 decode steps at 32 sequences, each run a fresh process).
# usage: ab_avx2_gemm.sh REPO   (from this directory, the machine otherwise idle)
REPO=$(readlink -f $1); T=$(mktemp -d)
HARNESS=$REPO/docs/bench/2026-12-07g/scripts/gemm_h.c
F="-O3 -mavx2 -mfma -mf16c -fopenmp"   # what native.py builds for an AVX2-only CPU
git -C $REPO worktree add -f $T/BASE 54c294a~1 > /dev/null 2>&1
git -C $REPO worktree add -f $T/NEW 54c294a > /dev/null 2>&1
for v in BASE NEW; do
  gcc $F -DKERNELS="\"$T/$v/tokenmill/layers/cpu_kernels.c\"" $HARNESS -o $T/h_$v -lm
done
for i in 1 2 3; do for v in BASE NEW; do
  for m in 32 8; do
    echo -n "$v kernel 1 thread: "; $T/h_$v 30 $m 1 5; echo -n "$v kernel 2 threads: "; $T/h_$v 30 $m 2 5
  done
done; done
echo -n "W cached (1 layer), BASE: "; $T/h_BASE 1 32 2 20
for i in 1 2 3; do for v in BASE NEW; do
  echo -n "$v engine: "; (cd $T && PYTHONPATH=$T/$v python $REPO/docs/bench/2026-12-07e/scripts/decode32.py float32 avx2 2>&1 | grep ms/step | tail -3 | tr '\n' ' '); echo
done; done
git -C $REPO worktree remove -f $T/BASE; git -C $REPO worktree remove -f $T/NEW
