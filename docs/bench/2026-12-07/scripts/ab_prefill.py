"""In-process prefill A/B of cpu_prefill.c: HEAD's against the working tree's, one engine, alternated.
python ab_prefill.py MODEL PREC CTX [ROUNDS]"""
import sys, subprocess, random, statistics
sys.path.insert(0, "docs/bench/2026-12-06f/scripts")
from builds import library
from tokenmill.layers import native
model, prec, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]); rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
libs = {"old": library({"cpu_prefill.c": subprocess.run(["git", "show", "HEAD:tokenmill/layers/cpu_prefill.c"], capture_output=True, text=True).stdout}),
        "new": native.library()}
current = ["new"]
class P:
    def __getattr__(self, name): return getattr(libs[current[0]], name)
proxy = P(); native.library = lambda: proxy
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
e = TokenmillEngine(dict(precision=prec, model_path=model, max_seq_len=ctx + 64, num_threads=2,
                         max_num_seqs=32, prefill_len=512, kv_cache_dtype="fp16"))
rng = random.Random(0); p = [rng.randrange(100, 30000) for _ in range(ctx)]
e.single(p[:600], 1)
res = {k: [] for k in libs}
for r in range(rounds):
    for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
        current[0] = k
        _, first, _ = e.single(p, 1); res[k].append(first)
        print(k, f"{first:.2f} s", flush=True)
for k in libs: print(f"{k}: prefill {ctx} median {statistics.median(res[k]):.2f} s = {ctx/statistics.median(res[k]):.0f} tok/s")
print("per round new/old speed:", " ".join(f"{o/n:.3f}" for o, n in zip(res["old"], res["new"])))
