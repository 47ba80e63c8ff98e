"""bf16 mode (cpu_gemm_dtype="bfloat16") with its K/V cache in float32 (auto), bfloat16 and
float16, interleaved in one process: 32 prompts of 128 random token ids, 128 greedy tokens each,
one generate call (bench compare's throughput workload), no prefix caching; ROUNDS rounds. Prints output tok/s per
round, the medians, and how many of the 32 outputs equal the float32-cache ones.
usage: python bf16_kv_throughput.py [ROUNDS]"""
import statistics, sys, time
import torch
from tokenmill import LLM, SamplingParams

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()} for _ in range(32)]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
engines = {kv: LLM(model="smollm2-135m", cpu_gemm_dtype="bfloat16", num_threads=2, max_num_seqs=32,
                   kv_cache_dtype=kv, enable_prefix_caching=False) for kv in ("auto", "bfloat16", "fp16")}
speed = {kv: [] for kv in engines}
outs = {}
for r in range(rounds):
    for kv, llm in engines.items():
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        speed[kv].append(sum(len(o.outputs[0].token_ids) for o in res) / dt)
        outs[kv] = [o.outputs[0].token_ids for o in res]
    print(f"round {r}: " + "  ".join(f"{kv} {v[-1]:.1f}" for kv, v in speed.items()), flush=True)
for kv in engines:
    same = sum(a == b for a, b in zip(outs[kv], outs["auto"]))
    print(f"kv {kv}: median {statistics.median(speed[kv]):.1f} out tok/s "
          f"({statistics.median(a / b for a, b in zip(speed[kv], speed['auto'])):.3f}x auto), "
          f"{same}/32 outputs equal to the float32 cache's")
