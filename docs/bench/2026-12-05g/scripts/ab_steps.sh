#!/bin/bash
# usage: ab_steps.sh OLD_TREE NEW_TREE MODEL ROUNDS: step_parts.py per tree, alternating processes
old=$1; new=$2; model=$3; rounds=${4:-3}
here=$(dirname "$0")
for r in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    echo "== $tree"
    PYTHONPATH=$tree python "$here/step_parts.py" "$model" 2>&1 | grep "^build_input"
  done
done
