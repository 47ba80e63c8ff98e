#!/bin/bash
# Old tree (a worktree) against this one, processes alternating: step_parts.py's batch-1
# medians (plain step, EAGLE-3 int8 k 3 chain step and its drafting) for each, ROUNDS times.
# usage: ab_draft_step.sh OLD_TREE NEW_TREE EAGLE3_DIR ROUNDS
old=$1; new=$2; eagle=$3; rounds=${4:-2}
script=$(cd "$(dirname "$0")" && pwd)/step_parts.py
for r in $(seq 1 $rounds); do
  for tree in $old $new; do
    echo "== round $r tree $tree"
    (cd $tree && PYTHONPATH=$tree python $script $eagle 3 chain 0 2>&1 | grep -E "^(plain|eagle3)"; true)
  done
done
