#!/bin/bash
# The closing runs of this session, one after another on an otherwise idle machine: SmolLM2 against
# llama.cpp (gguf-q8 on the same GGUF, its f16 K/V: --kv-cache-dtype fp16, contexts), SmolLM2 against vLLM-CPU (fp32 and
# bf16; tokenmill's bf16 row keeps bf16 K/V), Gemma3 against llama.cpp (contexts), then served bf16 and fp32.
# usage: closing.sh OUTDIR
OUT=$1; HERE=$(dirname "$(readlink -f "$0")")
. /work/venv/bin/activate
cd /tmp
date > $OUT/times.txt
tokenmill bench compare --model smollm2-135m --peers llama.cpp --llamacpp-python /work/llama-venv/bin/python \
  --precisions gguf-q8 --llamacpp-precisions gguf \
  --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 2 \
  --kv-cache-dtype fp16 --num-threads 2 --contexts 512,2048,4096,8192 --no-progress \
  --output-dir $OUT/compare-smollm2-llamacpp > $OUT/compare-smollm2-llamacpp.txt 2>&1
date >> $OUT/times.txt
VLLM_CPU_OMP_THREADS_BIND=0-1 tokenmill bench compare --model smollm2-135m --peers vllm \
  --vllm-python /work/vllm-venv/bin/python --vllm-model /work/smollm2-hf --vllm-precisions fp32,bf16 \
  --precisions fp32,bf16 --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 \
  --prefill-len 512 --repeats 2 --num-threads 2 --no-progress \
  --output-dir $OUT/compare-smollm2-vllm > $OUT/compare-smollm2-vllm.txt 2>&1
date >> $OUT/times.txt
tokenmill bench compare --model gemma3-270m --peers llama.cpp --llamacpp-python /work/llama-venv/bin/python \
  --precisions gguf-q8 --llamacpp-precisions gguf --dataset random --num-prompts 32 --max-input-len 128 \
  --output-len 128 --prefill-len 512 --repeats 2 --kv-cache-dtype fp16 --num-threads 2 \
  --contexts 512,2048,4096,8192 --no-progress --output-dir $OUT/compare-gemma3 > $OUT/compare-gemma3.txt 2>&1
date >> $OUT/times.txt
mkdir -p $OUT/serve
bash $HERE/serve_pair.sh $OUT/serve bf16 > $OUT/serve/bf16.txt 2>&1
bash $HERE/serve_pair.sh $OUT/serve fp32 > $OUT/serve/fp32.txt 2>&1
date >> $OUT/times.txt
