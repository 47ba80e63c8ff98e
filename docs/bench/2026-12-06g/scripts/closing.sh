#!/bin/bash
# The closing runs on one machine, one after another: SmolLM2 (llama.cpp with contexts; vLLM fp32), Gemma3
# (llama.cpp, contexts), then served fp32 against vLLM's server. usage: closing.sh OUTDIR
OUT=$1; HERE=$(dirname "$(readlink -f "$0")")
. /work/venv/bin/activate
cd /tmp
lscpu | grep -E "Model name|^Model:|Flags" | cut -c1-120 > $OUT/machine.txt
date >> $OUT/machine.txt
# SmolLM2 against llama.cpp on the same file: fp16 K/V (llama.cpp's f16), contexts
tokenmill bench compare --model smollm2-135m --peers llama.cpp --llamacpp-python /work/llama-venv/bin/python \
  --precisions gguf-q8 --llamacpp-precisions gguf \
  --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 3 \
  --kv-cache-dtype fp16 --num-threads 2 --rounds 2 --contexts 512,2048,4096,8192 \
  --output-dir $OUT/compare-smollm2 > $OUT/compare-smollm2.txt 2>&1
date >> $OUT/machine.txt
# SmolLM2 float32 against vLLM-CPU float32: float32 K/V on both sides (the default)
VLLM_CPU_OMP_THREADS_BIND=0-1 tokenmill bench compare --model smollm2-135m --peers vllm \
  --vllm-python /work/vllm-venv/bin/python --vllm-model /work/smollm2-hf --vllm-precisions fp32 --precisions fp32 \
  --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 3 \
  --num-threads 2 --rounds 2 --output-dir $OUT/compare-smollm2-vllm > $OUT/compare-smollm2-vllm.txt 2>&1
date >> $OUT/machine.txt
tokenmill bench compare --model gemma3-270m --peers llama.cpp --llamacpp-python /work/llama-venv/bin/python \
  --precisions gguf-q8 --llamacpp-precisions gguf --dataset random --num-prompts 32 --max-input-len 128 \
  --output-len 128 --prefill-len 512 --repeats 3 --kv-cache-dtype fp16 --num-threads 2 --rounds 2 \
  --contexts 512,2048,4096,8192 --output-dir $OUT/compare-gemma3 > $OUT/compare-gemma3.txt 2>&1
date >> $OUT/machine.txt
bash $HERE/serve_fp32.sh $OUT > $OUT/served.txt 2>&1
date >> $OUT/machine.txt
