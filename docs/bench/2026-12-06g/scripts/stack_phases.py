"""Per-phase time inside tm_llama_decode (a copy of cpu_decode.c with clock_gettime around each
phase), batch-1 decode of MODEL (gguf-q8, fp16 K/V), 256 steps after a 128-token prompt."""
import os, sys, random, ctypes
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../2026-12-06f/scripts"))
from builds import library
from tokenmill.layers import native
src = open(os.path.join(os.path.dirname(native.SOURCE), "cpu_decode.c")).read()
PH = ["norm_in", "qkv", "qk_norm", "rope_kv", "attn", "o", "resid_norms", "gate_up", "act", "down", "ffn_resid"]
hdr = ("#include <time.h>\ndouble tm_dbg_t[16];\nstatic inline double dbg_now(void){struct timespec t;"
       "clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}\n"
       "#define TICK(i) do { double _n = dbg_now(); tm_dbg_t[i] += _n - _t; _t = _n; } while (0)\n")
src = hdr + src
def sub(old, new):
    global src
    assert old in src, old
    src = src.replace(old, new, 1)
sub("    norm(ld, LD_NORM_IN, x, NULL, s->T, s->H, w->h, s->nthreads);\n    if (dec_linear(lin,",
    "    double _t = dbg_now();\n    norm(ld, LD_NORM_IN, x, NULL, s->T, s->H, w->h, s->nthreads); TICK(0);\n    if (dec_linear(lin,")
sub("        return 2;\n    if (ld[LD_Q_NORM]) qk_norm(ld, s, w->qkv);",
    "        return 2;\n    TICK(1); if (ld[LD_Q_NORM]) qk_norm(ld, s, w->qkv); TICK(2);")
sub("    write_kv(w->qkv, s->T, s->Hq, s->Hkv, s->D, slots, kc, vc, ks, vs, s->kv_dt);\n",
    "    write_kv(w->qkv, s->T, s->Hq, s->Hkv, s->D, slots, kc, vc, ks, vs, s->kv_dt); TICK(3);\n")
sub("        return 1;\n    return dec_linear(lin + per_linear, bias(ld, LD_BIAS_O), w->att, s->T, qd, s->H, w->h, w->tmp,\n                      w->xp, s->q8, s->nthreads) ? 2 : 0;",
    "        return 1;\n    TICK(4); int _r = dec_linear(lin + per_linear, bias(ld, LD_BIAS_O), w->att, s->T, qd, s->H, w->h, w->tmp,\n                      w->xp, s->q8, s->nthreads) ? 2 : 0; TICK(5); return _r;")
sub("    const int64_t *lin = (const int64_t *)ld[LD_LINEARS], per_linear = DEC_PARTS * DEC_FIELDS;\n    if (dec_linear(lin + 2 * per_linear,",
    "    const int64_t *lin = (const int64_t *)ld[LD_LINEARS], per_linear = DEC_PARTS * DEC_FIELDS;\n    double _t = dbg_now();\n    if (dec_linear(lin + 2 * per_linear,")
sub("        return 2;\n    if (ld[LD_ACT] == DEC_ACT_GELU_TANH)", "        return 2;\n    TICK(7); if (ld[LD_ACT] == DEC_ACT_GELU_TANH)")
sub("    else tm_silu_mul(w->gu, s->T, s->I, w->act, s->nthreads);\n    return dec_linear(lin + 3 * per_linear, bias(ld, LD_BIAS_DOWN), w->act, s->T, s->I, s->H, w->h,\n                      w->tmp, w->xp, s->q8, s->nthreads) ? 2 : 0;",
    "    else tm_silu_mul(w->gu, s->T, s->I, w->act, s->nthreads);\n    TICK(8); int _r = dec_linear(lin + 3 * per_linear, bias(ld, LD_BIAS_DOWN), w->act, s->T, s->I, s->H, w->h,\n                      w->tmp, w->xp, s->q8, s->nthreads) ? 2 : 0; TICK(9); return _r;")
sub("        attention_residual(ld, &s, x, &w);", "        double _t = dbg_now(); attention_residual(ld, &s, x, &w); TICK(6);")
sub("        ffn_residual(ld, &s, x, &w);", "        _t = dbg_now(); ffn_residual(ld, &s, x, &w); TICK(10);")
lib = library({"cpu_decode.c": src})
native.library = lambda: lib
arr = (ctypes.c_double * 16).in_dll(lib, "tm_dbg_t")
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
model = sys.argv[1]
e = TokenmillEngine(dict(precision="gguf-q8", model_path=model, max_seq_len=1024, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
rng = random.Random(0)
p = [rng.randrange(100, 30000) for _ in range(128)]
e.single(p, 8)
for _ in range(3):
    for i in range(16): arr[i] = 0
    toks, first, tot = e.single(p, 257)
    step = (tot - first) / 256
    tot_ph = sum(arr[i] for i in range(len(PH)))
    print(f"step {step*1e3:.2f} ms, phases {tot_ph/257*1e3:.2f} ms: " + ", ".join(f"{n} {arr[i]/257*1e6:.0f}" for i, n in enumerate(PH)), flush=True)
