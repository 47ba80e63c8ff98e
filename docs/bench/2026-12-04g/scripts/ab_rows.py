# usage: python ab_rows.py TREE PRECISION: SmolLM2-135M through bench compare's tokenmill engine from
# the source tree TREE; prints one JSON line: prefill tok/s of a 512-token prompt (best of 3),
# batch-1 decode tok/s (128 tokens after a 16-token prompt, best of 2), and offline throughput
# (32 random 128-token prompts, 128 new tokens each, one generate).
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from tokenmill.bench.peers.tokenmill_engine import TokenmillEngine

prec = sys.argv[2]
spec = dict(precision=prec, model_path="/root/.cache/tokenmill/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
            max_seq_len=640, max_num_seqs=32, prefill_len=512, num_threads=2)
e = TokenmillEngine(spec)
rng = random.Random(0)
long = [rng.randrange(100, 49000) for _ in range(512)]
prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(32)]
e.batch(prompts[:4], 8)
prefill = max(512 / e.single(long, 1)[2] for _ in range(3))
decode = 0.0
for _ in range(2):
    tokens, first, total = e.single(long[:16], 128)
    decode = max(decode, (len(tokens) - 1) / (total - first))
t = time.perf_counter()
e.batch(prompts, 128)
throughput = 32 * 128 / (time.perf_counter() - t)
print(json.dumps({"tree": sys.argv[1], "precision": prec, "prefill_512_tok_s": round(prefill, 1),
                  "decode_b1_tok_s": round(decode, 1), "throughput_32x128_tok_s": round(throughput, 1)}))
