# usage: python throughput_ab.py PRECISION [prof|x] [TREE]: 32 random 128-token prompts, 128 new tokens each, one generate (bench compare's throughput row), tok/s; "prof" adds a cProfile
import sys, time, random, cProfile, pstats
sys.path.insert(0, sys.argv[3] if len(sys.argv) > 3 else "/work/main")
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine
prec = sys.argv[1] if len(sys.argv) > 1 else "fp32"
spec = dict(precision=prec, model_path="/root/.cache/tokenmill/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
            max_seq_len=256+8, max_num_seqs=32, prefill_len=512, num_threads=2)
e = TokenmillEngine(spec)
rng = random.Random(0)
prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(32)]
e.batch(prompts[:4], 8)
t = time.perf_counter(); e.batch(prompts, 128); dt = time.perf_counter() - t
print(f"{prec}: {32*128/dt:.1f} tok/s, {dt:.2f}s")
if len(sys.argv) > 2 and sys.argv[2] == "prof":
    pr = cProfile.Profile(); pr.enable(); e.batch(prompts, 128); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
