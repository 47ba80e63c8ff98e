#!/bin/bash
# The rows an AVX2-only CPU runs, on this Xeon: tokenmill under --cpu-isa avx2 (its AVX2 build,
# torch's and oneDNN's kernels capped at AVX2) against llama.cpp built without AVX-512
# (/work/llama-avx2-venv: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
# -DGGML_F16C=ON -DGGML_AVX512=OFF ..."), the same GGUF, fp16 K/V, contexts: SmolLM2 fp32 and
# gguf-q8, then Gemma3-270m gguf-q8.
# usage: closing_avx2.sh OUTDIR [smollm2-only]   (the machine otherwise idle; this session ran
# the SmolLM2 command, then the Gemma3 one alone)
OUT=$1
. /work/venv/bin/activate
cd /tmp
date > $OUT/times_avx2.txt
tokenmill bench compare --model smollm2-135m --peers llama.cpp --llamacpp-python /work/llama-avx2-venv/bin/python \
  --cpu-isa avx2 --precisions fp32,gguf-q8 --llamacpp-precisions gguf \
  --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 2 \
  --kv-cache-dtype fp16 --num-threads 2 --contexts 512,2048,4096,8192 --no-progress \
  --output-dir $OUT/compare-smollm2-avx2 > $OUT/compare-smollm2-avx2.txt 2>&1
date >> $OUT/times_avx2.txt
[ "$2" = smollm2-only ] && exit
tokenmill bench compare --model gemma3-270m --peers llama.cpp --llamacpp-python /work/llama-avx2-venv/bin/python \
  --cpu-isa avx2 --precisions gguf-q8 --llamacpp-precisions gguf \
  --dataset random --num-prompts 32 --max-input-len 128 --output-len 128 --prefill-len 512 --repeats 2 \
  --kv-cache-dtype fp16 --num-threads 2 --contexts 512,2048,4096,8192 --no-progress \
  --output-dir $OUT/compare-gemma3-avx2 > $OUT/compare-gemma3-avx2.txt 2>&1
date >> $OUT/times_avx2.txt
