#!/bin/bash
# Issue 18's closing rows that 2026-12-07c lacked, SmolLM2-135M float32 target, each against no
# speculation and n-gram lookup in the same run: Medusa (4 heads, k 3) and the distilled draft
# model (6 layers, k 3) trained here; then EAGLE-3 with prompt lookup first and a draft tree
# (two candidates at the first position) next to the same chain, at T = 0.
# usage: spec_new_rows.sh OUTDIR MEDUSA_DIR DRAFT_MODEL_DIR EAGLE3_DIR
set -e
out=$1; medusa=$2; dm=$3; eagle=$4
common="--workloads chat,grounded --batch-sizes 1,8 --repeats 2 --max-tokens 96 --num-threads 2 --no-progress"
date -u +"medusa + draft model start %H:%M:%S"
tokenmill bench spec $common --temperature 0,1 \
    --methods ngram,medusa,adaptive_ngram_medusa,draft_model,adaptive_ngram_draft_model \
    --drafter medusa=$medusa --drafter draft_model=$dm --k 3 --output-dir $out/spec-medusa-dm > $out/spec-medusa-dm.log 2>&1
date -u +"eagle3 tree start %H:%M:%S"
tokenmill bench spec --workloads chat,grounded --batch-sizes 1 --repeats 2 --max-tokens 96 --num-threads 2 \
    --no-progress --temperature 0 \
    --methods ngram,adaptive_ngram_eagle3_int8,adaptive_ngram_eagle3_int8_tree --drafter eagle3=$eagle --k 3 \
    --token-tree "[(0,), (1,), (0, 0), (0, 0, 0)]" --output-dir $out/spec-eagle3-tree > $out/spec-eagle3-tree.log 2>&1
date -u +"end %H:%M:%S"
