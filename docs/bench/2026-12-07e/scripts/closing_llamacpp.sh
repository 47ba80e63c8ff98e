#!/bin/bash
# llama.cpp's rows again with a build without AMX (its native build, AMX_INT8 on, crashed in the
# compare's worker here): gguf-q8 against llama.cpp on the same GGUFs, fp16 K/V, contexts. usage: OUTDIR
OUT=$1
. /work/venv/bin/activate
cd /tmp
date > $OUT/times_llamacpp.txt
for M in smollm2-135m gemma3-270m; do
  tokenmill bench compare --model $M --peers llama.cpp --llamacpp-python /work/llama-noamx-venv/bin/python \
    --precisions gguf-q8 --llamacpp-precisions gguf \
    --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 2 \
    --kv-cache-dtype fp16 --num-threads 2 --contexts 512,2048,4096,8192 --no-progress \
    --output-dir $OUT/compare-$M-llamacpp-noamx > $OUT/compare-$M-llamacpp-noamx.txt 2>&1
  date >> $OUT/times_llamacpp.txt
done
