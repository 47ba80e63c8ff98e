#!/bin/bash
# SmolLM2 and Gemma 3 gguf-q8 against llama.cpp on the same files (fp16 K/V on both sides), with the
# contexts, one after the other: the settings of 2026-12-06g's closing runs. usage: closing.sh OUTDIR
OUT=$(readlink -f $1)
. /work/venv/bin/activate
cd /tmp
lscpu | grep -E "Model name|^Model:|Flags" | cut -c1-120 > $OUT/machine.txt
date >> $OUT/machine.txt
for model in smollm2-135m gemma3-270m; do
  tokenmill bench compare --model $model --peers llama.cpp --llamacpp-python /work/llama-venv/bin/python \
    --precisions gguf-q8 --llamacpp-precisions gguf \
    --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 3 \
    --kv-cache-dtype fp16 --num-threads 2 --rounds 2 --contexts 512,2048,4096,8192 \
    --output-dir $OUT/compare-$model > $OUT/compare-$model.txt 2>&1
  date >> $OUT/machine.txt
done
