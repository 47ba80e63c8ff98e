args="$1"; shift
declare -A best
for r in 1 2 3 4 5; do for v in "$@"; do
  x=$(/tmp/c/hp_$v $args | sed 's/.*: \([0-9.]*\) ms.*/\1/')
  b=${best[$v]:-999999}; best[$v]=$(python3 -c "print(min($b,$x))")
done; done
for v in "$@"; do echo -n "$v ${best[$v]}  "; done; echo " ms ($args)"
