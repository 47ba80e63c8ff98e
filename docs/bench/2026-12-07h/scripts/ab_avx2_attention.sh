#!/bin/bash
# Interleaved A/B of the AVX2 build's decode attention score loop (three heads a pass): BASE =
# the commit before COMMIT, NEW = COMMIT. The kernel alone in both builds
# (2026-12-07/scripts/decode_harness.c: 30 layers of 8192 fp16 keys from memory, 2 threads; 1024
# keys in cache, 1 thread), then the engine under cpu_isa="avx2" (2026-12-07f's longdec.py:
# SmolLM2 gguf-q8, fp16 K/V, a 6000-token prompt, decode tok/s over steps 200-400).
# usage: ab_avx2_attention.sh REPO COMMIT   (from anywhere, the machine otherwise idle)
REPO=$(readlink -f $1); C=$2; T=$(mktemp -d)
HARNESS=$REPO/docs/bench/2026-12-07/scripts/decode_harness.c
F2="-O3 -mavx2 -mfma -mf16c -fopenmp"; F5="$F2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni"
git -C $REPO worktree add -f $T/BASE $C~1 > /dev/null 2>&1
git -C $REPO worktree add -f $T/NEW $C > /dev/null 2>&1
for v in BASE NEW; do
  gcc $F2 -DKERNELS="\"$T/$v/tokenmill/layers/cpu_kernels.c\"" $HARNESS -o $T/avx2_$v -lm
  gcc $F5 -DKERNELS="\"$T/$v/tokenmill/layers/cpu_kernels.c\"" $HARNESS -o $T/avx512_$v -lm
done
for i in 1 2 3; do for b in avx2 avx512; do for v in BASE NEW; do
  echo -n "$b $v memory: "; $T/${b}_$v 9 3 64 8192 30 2 5; echo -n "$b $v cache: "; $T/${b}_$v 9 3 64 1024 1 1 200
done; done; done
for i in 1 2 3; do for v in BASE NEW; do
  echo -n "$v engine avx2: "; (cd $T && PYTHONPATH=$T/$v python $REPO/docs/bench/2026-12-07f/scripts/longdec.py 6000 400 gguf-q8 fp16 avx2 2>&1 | grep steps | tail -3 | head -2 | tr '\n' ' '); echo
done; done
git -C $REPO worktree remove -f $T/BASE; git -C $REPO worktree remove -f $T/NEW
