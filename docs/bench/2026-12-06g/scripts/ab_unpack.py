"""A/B of qgemm.c (OLD: the commit in $OLD, default 9abbf14~1, the one before the change; NEW: the working tree) on Gemma3's real tiles of layer 0 (+ SmolLM2-like
Q4_1 tiles), rows M: outputs must be bit-identical; time ratio (interleaved, median)."""
import sys, os, subprocess, time, statistics, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../2026-12-06f/scripts"))
from builds import library
from tokenmill.layers.quant import formats, qgemm
old_src = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "show", os.environ.get("OLD", "9abbf14~1") + ":tokenmill/layers/quant/qgemm.c"], capture_output=True, text=True).stdout
libs = {"old": library({"quant/qgemm.c": old_src}), "new": library()}
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
M = os.path.expanduser('~/.cache/tokenmill/gemma3-270m/gemma-3-270m-q4_k_m.gguf')  # tokenmill pull gemma3-270m
e = TokenmillEngine(dict(precision='gguf-q8', model_path=M, max_seq_len=1024, num_threads=2, max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
m = e.llm.engine.model
seen = {}
for name, mod in m.named_modules():
    if 'head' in name or 'embed' in name: continue
    for p in (mod.__dict__.get('packed') or []):
        t = p.tiled
        if t is not None: seen.setdefault((name.split('.')[-1], t.kind, t.group_size, t.mn is not None), t)
torch.manual_seed(0)
for half in (True, False):
    p = formats.quantize_int4(torch.randn(3072, 576) * 0.05, 32)
    if half: p.scales = p.scales.half(); p.mins = p.mins.half()
    seen[("smol_gate_up_q4_1" + ("_half" if half else "_f32"), 1, 32, True)] = qgemm.tile(p)
rows_list = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [5, 16, 64, 512]
for key, t in seen.items():
    line = []
    for rows in rows_list:
        x = torch.randn(rows, t.in_features) * 3
        ys = {k: torch.empty(rows, t.out_features) for k in libs}
        def call(k):
            libs[k].tm_qgemm_q8(x.data_ptr(), rows, t.in_features, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                                t.mn.data_ptr() if t.mn is not None else 0, t.group_size, t.out_features, ys[k].data_ptr(), 2)
        for k in libs: call(k)
        assert torch.equal(ys["old"], ys["new"]), (key, rows)
        times = {k: [] for k in libs}
        for _ in range(int(os.environ.get("ROUNDS", 9))):
            for k in libs:
                t0 = time.perf_counter(); call(k); times[k].append(time.perf_counter() - t0)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        line.append(f"M{rows}: {2*rows*t.in_features*t.out_features/n/1e9:.0f} GOPS x{o/n:.2f}")
    print(key, f"{t.out_features}x{t.in_features}", " | ".join(line), flush=True)
