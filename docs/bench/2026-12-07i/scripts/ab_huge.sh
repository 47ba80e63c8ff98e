#!/bin/bash
# huge pages off / on in the engine, fresh processes alternated, ROUNDS rounds: B=1 decode of
# SmolLM2 gguf-q8 and fp32 after 500 / 4000 / 8000 prompt tokens (hugedec.py), then fp32
# decode at 32 sequences (2026-12-07e's decode32.py, its 5th argument). usage: ab_huge.sh [ROUNDS]
R=${1:-3}; HERE=$(dirname "$(readlink -f "$0")")
. /work/venv/bin/activate
for r in $(seq $R); do
  for cfg in "500 400 gguf-q8" "4000 300 gguf-q8" "8000 150 gguf-q8" "500 300 fp32" "4000 200 fp32"; do
    set -- $cfg
    for h in 0 1; do python $HERE/hugedec.py $1 $2 $h $3 2>&1 | grep " ctx "; done
  done
  for h in 0 1; do echo "decode32 float32 huge $h: $(python $HERE/../../2026-12-07e/scripts/decode32.py float32 native - auto $h 2>&1 | grep ms/step | tail -2 | tr '\n' ' ')"; done
done
