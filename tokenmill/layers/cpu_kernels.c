/* The fused CPU kernels as one library (one compilation unit, so the whole-stack decode
 * can call the per-op kernels directly). Built and loaded by tokenmill/layers/native.py. */
#include "cpu_ops.c"
#include "cpu_gemm.c"
#include "cpu_gemm_bf16.c"
#include "cpu_attention.c"
#include "cpu_prefill.c"
#include "cpu_prefill_amx.c"
#include "quant/qmm.c"
#include "cpu_decode_linear.c"
#include "cpu_decode.c"
#include "cpu_sync.c"
