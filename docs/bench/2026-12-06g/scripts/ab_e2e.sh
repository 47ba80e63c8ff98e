# usage: ab_e2e.sh MODEL [ROUNDS]: processes alternated between a worktree of the commit before the change
# (/tmp/wt_head: git worktree add /tmp/wt_head 9abbf14~1) and the working tree; prefill of 512 tokens,
# 5 runs a side per round (scripts/prefill.py), tok/s sorted
M=$1; R=${2:-3}; HERE=$(dirname "$(readlink -f "$0")"); TREE=$(git -C "$HERE" rev-parse --show-toplevel)
for r in $(seq $R); do
  for side in head new; do
    if [ $side = head ]; then P=/tmp/wt_head; else P=$TREE; fi
    echo "$side $(cd /tmp && PYTHONPATH=$P python $HERE/prefill.py $M gguf-q8 512 2>&1 | grep prefill | awk '{print $5}' | sort -n | tr '\n' ' ')"
  done
done
