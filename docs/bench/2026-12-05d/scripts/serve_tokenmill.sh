#!/bin/bash
# usage: serve_tokenmill.sh TREE LABEL OUTDIR [serve flags..]: tokenmill serve (default model; fp32
# unless the flags say otherwise) then bench serve, 64 random 128-word prompts, 64 tokens, 16 in flight
TREE=$1; LABEL=$2; OUT=$3; shift 3
. /work/venv/bin/activate
cd /tmp
PYTHONPATH=$TREE python -m tokenmill.entrypoints.cli serve --port 8011 --num-threads 2 "$@" > /tmp/serve_$LABEL.log 2>&1 &
PID=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
PYTHONPATH=$TREE python -m tokenmill.entrypoints.cli bench serve --base-url http://127.0.0.1:8011/v1 --dataset random --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 16 --ignore-eos --no-progress --output-dir $OUT/$LABEL 2>&1 | tail -25
kill $PID; wait $PID 2>/dev/null
