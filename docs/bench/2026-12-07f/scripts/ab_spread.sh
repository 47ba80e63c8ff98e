#!/bin/bash
# Interleaved A/B of the decode attention's prefetch: BASE = the commit before bb32f7b, NEW =
# bb32f7b. The kernel alone (docs/bench/2026-12-07/scripts/decode_harness.c: 30 layers' fp16
# caches of 8192 keys, SmolLM2's heads, blocks 7 apart, 2 threads), then the engine
# (longdec.py: SmolLM2 gguf-q8, fp16 K/V, a 6000-token prompt, 500 steps).
# usage: ab_spread.sh REPO   (from this directory, the machine otherwise idle)
REPO=$1; H=$(pwd); T=$(mktemp -d)
HARNESS=$REPO/docs/bench/2026-12-07/scripts/decode_harness.c
git -C $REPO show bb32f7b~1:tokenmill/layers/cpu_attention.c > $T/BASE.c
git -C $REPO show bb32f7b:tokenmill/layers/cpu_attention.c > $T/NEW.c
F="-O3 -mavx2 -mfma -mf16c -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512vnni"
for v in BASE NEW; do
  cp $T/$v.c $REPO/tokenmill/layers/cpu_attention.c
  gcc $F -DKERNELS="\"$REPO/tokenmill/layers/cpu_kernels.c\"" $HARNESS -o $T/$v -lm
done
for i in 1 2 3; do for v in BASE NEW; do echo -n "$v kernel: "; $T/$v 9 3 64 8192 30 2; done; done
for i in 1 2 3; do for v in BASE NEW; do
  cp $T/$v.c $REPO/tokenmill/layers/cpu_attention.c
  echo -n "$v engine: "; python $H/longdec.py 6000 500 gguf-q8 fp16 2>&1 | grep steps | tail -4 | head -3 | tr '\n' ' '; echo
done; done
git -C $REPO checkout tokenmill/layers/cpu_attention.c
