"""Batch-1 (and batch-4) gguf-q8 decode with the kernel library built with a given tiled-GEMM
prefetch distance (0 = none): one process per variant, the variants interleaved over rounds
by the driver (the box's speed moves between minutes).

    python e2e_prefetch.py drive MODEL 0,2048,4096 ROUNDS
    python e2e_prefetch.py one MODEL DISTANCE      (prints JSON: tok/s)"""
import json, statistics, subprocess, sys, time

def one(model, distance):
    from tokenmill.layers import native
    d = int(distance)
    native.build_flags.__defaults__ = (None, bool(d))
    native._QG_PREFETCH_FLAG = f"-DTM_QG_PREFETCH={d}"
    from tokenmill import LLM, SamplingParams
    llm = LLM(model=model, quantization="gguf", quant_activations="q8", num_threads=2,
              skip_tokenizer_init=True, max_model_len=1024, enable_prefix_caching=False)
    assert ("-DTM_QG_PREFETCH" in " ".join(native.build_flags())) == bool(d)
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    out = {}
    for b in (1, 4):
        prompts = [{"prompt_token_ids": [1 + 7 * i + j for j in range(16)]} for i in range(b)]
        llm.generate(prompts, sp, use_tqdm=False)
        runs = []
        for _ in range(3):
            t0 = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False)
            runs.append(b * 128 / (time.perf_counter() - t0))
        out[f"b{b}"] = statistics.median(runs)
    print(json.dumps(out))

def drive(model, distances, rounds):
    res = {d: [] for d in distances.split(",")}
    for r in range(int(rounds)):
        for d in res:
            p = subprocess.run([sys.executable, __file__, "one", model, d], capture_output=True, text=True)
            res[d].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(r, d, res[d][-1], flush=True)
    base = min(res, key=int)
    for d, v in res.items():
        line = []
        for k in ("b1", "b4"):
            med = statistics.median(x[k] for x in v)
            ratios = [x[k] / y[k] for x, y in zip(v, res[base])]
            line.append(f"{k} {med:.1f} tok/s (per-round ratio median {statistics.median(ratios):.3f})")
        print(f"prefetch {d}: " + ", ".join(line))

if __name__ == "__main__":
    one(*sys.argv[2:]) if sys.argv[1] == "one" else drive(*sys.argv[2:])
