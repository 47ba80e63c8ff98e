#!/bin/bash
# Issue 18's closing `bench spec` runs on SmolLM2-135M, each against no speculation and n-gram
# lookup in the same run: EAGLE-3 (k 3) with the float32 target and with GGUF q8 weights, then
# DFlash (blocks of 8: k 7) with the float32 target.
# usage: spec_closing.sh OUTDIR EAGLE3_DIR DFLASH_DIR
set -e
out=$1; eagle=$2; dflash=$3
common="--workloads chat,grounded --temperature 0,1 --batch-sizes 1,8 --repeats 2 --max-tokens 96
        --num-threads 2 --no-progress"
eagle_methods="--methods ngram,eagle3_int8,ngram_eagle3_int8,adaptive_ngram_eagle3_int8 --drafter eagle3=$eagle --k 3"
date -u +"eagle3 fp32 start %H:%M:%S"
tokenmill bench spec $common $eagle_methods --output-dir $out/spec-fp32 > $out/spec-fp32.log 2>&1
date -u +"eagle3 gguf-q8 start %H:%M:%S"
tokenmill bench spec $common $eagle_methods --quantization gguf --quant-activations q8 \
    --output-dir $out/spec-gguf-q8 > $out/spec-gguf-q8.log 2>&1
date -u +"dflash fp32 start %H:%M:%S"
tokenmill bench spec $common --methods ngram,dflash_int8,adaptive_ngram_dflash_int8 --drafter dflash=$dflash \
    --k 7 --output-dir $out/spec-dflash-fp32 > $out/spec-dflash-fp32.log 2>&1
date -u +"end %H:%M:%S"
