#!/bin/bash
# Interleaved A/B of keep_freed_heap: BASE = the commit before 375b4df, NEW = 375b4df.
# thr32.py (32 random 128-token prompts, 128 new tokens each, the default 2048-token step
# budget) in bf16 mode with bf16 K/V, then fp32; each run a fresh process, its peak RSS by
# /usr/bin/time.
# usage: ab_keep_heap.sh REPO   (from this directory, the machine otherwise idle)
REPO=$(readlink -f $1); H=$(pwd); T=$(mktemp -d)
git -C $REPO worktree add -f $T/BASE 375b4df~1 > /dev/null 2>&1
git -C $REPO worktree add -f $T/NEW 375b4df > /dev/null 2>&1
for args in "bfloat16 bf16 2048" "float32 auto 2048"; do
  for i in 1 2 3; do for v in BASE NEW; do
    echo -n "$v $args: "
    (cd $T && PYTHONPATH=$T/$v /usr/bin/time -f "peak RSS %M KB" python $H/thr32.py $args 2>&1 | tail -2 | tr '\n' ' '); echo
  done; done
done
git -C $REPO worktree remove -f $T/BASE; git -C $REPO worktree remove -f $T/NEW
