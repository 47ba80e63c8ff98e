"""As ab_inproc.py, prefill only, also timing tm_qgemm_q8 calls inside it (proxy)."""
import sys, os, subprocess, time, random, statistics, collections
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../2026-12-06f/scripts"))
from builds import library
from tokenmill.layers import native
old_src = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "show", os.environ.get("OLD", "9abbf14~1") + ":tokenmill/layers/quant/qgemm.c"], capture_output=True, text=True).stdout
libs = {"old": library({"quant/qgemm.c": old_src}), "new": native.library()}
current = ["new"]; acc = collections.Counter()
class P:
    def __getattr__(self, name):
        f = getattr(libs[current[0]], name)
        if name != "tm_qgemm_q8": return f
        def w(*a):
            t = time.perf_counter(); r = f(*a); acc[current[0]] += time.perf_counter() - t; return r
        return w
proxy = P(); native.library = lambda: proxy
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
model, n = sys.argv[1], int(sys.argv[2])
e = TokenmillEngine(dict(precision="gguf-q8", model_path=model, max_seq_len=n + 64, num_threads=2,
                         max_num_seqs=32, prefill_len=n, kv_cache_dtype="fp16"))
rng = random.Random(0)
pf = [rng.randrange(0, 30000) for _ in range(n)]
for k in libs: current[0] = k; e.single(pf, 2)
res = {k: [] for k in libs}; mm = {k: [] for k in libs}
for r in range(int(os.environ.get("ROUNDS", 8))):
    for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
        current[0] = k; acc.clear()
        _, first, _ = e.single(pf, 1); res[k].append(first); mm[k].append(acc[k])
for k in libs:
    print(f"{k}: prefill median {statistics.median(res[k])*1e3:.0f} ms, of which tm_qgemm_q8 {statistics.median(mm[k])*1e3:.0f} ms")
print("per round prefill new/old speed:", " ".join(f"{o/nw:.2f}" for o, nw in zip(res["old"], res["new"])))
print("per round qgemm new/old speed:", " ".join(f"{o/nw:.2f}" for o, nw in zip(mm["old"], mm["new"])))
