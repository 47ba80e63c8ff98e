#!/bin/bash
# Issue 18's closing `bench spec` runs on SmolLM2-135M: the float32 target, then GGUF q8 weights
# (int8-rounded activations), each against no speculation and n-gram lookup in the same run.
# usage: spec_closing.sh OUTDIR EAGLE3_DIR
set -e
out=$1; eagle=$2
common="--methods ngram,eagle3_int8,ngram_eagle3_int8,adaptive_ngram_eagle3_int8 --drafter eagle3=$eagle
        --workloads chat,grounded --temperature 0,1 --batch-sizes 1,8 --k 3 --repeats 2 --max-tokens 96
        --num-threads 2 --no-progress"
date -u +"fp32 start %H:%M:%S"
tokenmill bench spec $common --output-dir $out/spec-fp32 > $out/spec-fp32.log 2>&1
date -u +"gguf-q8 start %H:%M:%S"
tokenmill bench spec $common --quantization gguf --quant-activations q8 --output-dir $out/spec-gguf-q8 > $out/spec-gguf-q8.log 2>&1
date -u +"end %H:%M:%S"
