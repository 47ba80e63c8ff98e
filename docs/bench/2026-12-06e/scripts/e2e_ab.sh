#!/bin/bash
# e2e_ab.sh OLD_TREE NEW_TREE MODEL PRECISION ROUNDS: e2e_one.py under each tree's tokenmill
# (PYTHONPATH), the two processes alternated round by round (the box's speed moves by minutes).
# OLD_TREE: e.g. `git worktree add /tmp/wt_old 17704f8`.
here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq "$5"); do
  for t in "$1" "$2"; do
    (cd /tmp && PYTHONPATH="$t" python "$here/e2e_one.py" "$3" "$4" 2>/dev/null | tail -1)
  done
done
