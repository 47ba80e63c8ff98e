#!/bin/bash
# This session's closing runs, one after another on an otherwise idle machine: SmolLM2 against
# vLLM-CPU (vllm_compare.sh, one round; then `vllm_compare.sh OUTDIR 2` for medians), served
# bf16 and fp32 (2026-12-07e's serve_pair.sh), then gguf-q8 against llama.cpp built without AMX
# on SmolLM2 and Gemma3 with contexts and fp16 K/V (2026-12-07e's closing_llamacpp.sh, which
# writes its own times_llamacpp.txt).
# usage: closing.sh OUTDIR
OUT=$(readlink -f $1); HERE=$(dirname "$(readlink -f "$0")"); E=$HERE/../../2026-12-07e/scripts
date > $OUT/times.txt
bash $HERE/vllm_compare.sh $OUT
date >> $OUT/times.txt
mkdir -p $OUT/serve
bash $E/serve_pair.sh $OUT/serve bf16 > $OUT/serve/bf16.txt 2>&1
bash $E/serve_pair.sh $OUT/serve fp32 > $OUT/serve/fp32.txt 2>&1
date >> $OUT/times.txt
bash $E/closing_llamacpp.sh $OUT
