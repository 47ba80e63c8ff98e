# usage: python prefill_profile.py PRECISION [TREE] [prof]: a 512-token prefill alone, seconds to the first token (5 runs), optional cProfile
import sys, random, cProfile, pstats
sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else "/work/main")
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
spec = dict(precision=sys.argv[1], model_path="/root/.cache/tokenmill/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
            max_seq_len=640, max_num_seqs=32, prefill_len=512, num_threads=2)
e = TokenmillEngine(spec)
rng = random.Random(0)
p = [rng.randrange(100, 49000) for _ in range(512)]
for _ in range(2): e.single(p, 1)
ts = []
for _ in range(5):
    _, first, _ = e.single([rng.randrange(100, 49000) for _ in range(512)], 1); ts.append(first)
print("prefill 512:", sorted(ts), f"{512/sorted(ts)[2]:.0f} tok/s")
if len(sys.argv) > 3:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5): e.single([rng.randrange(100, 49000) for _ in range(512)], 1)
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
